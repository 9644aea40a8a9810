"""`vllm-overlay revert-red`: the proof that each patch's tests need it."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_overlay.command import App, Subparsers, add_command
from vllm_overlay.gate.outcomes import load_outcomes
from vllm_overlay.gate.reports import encode_report
from vllm_overlay.gate.revert_red import build_report, format_table, gate


def cmd_revert_red(app: App, args: argparse.Namespace) -> int:
    """Compare a base and an overlay test run (unit-base) and gate on it.

    Compare the outcomes of the suite on the pinned base and with the
    overlay: every test a patch names in its Tests header must fail on the
    base and pass overlaid. Writes the report export reads.
    """
    checkout = app.checkout
    series = checkout.series
    report = build_report(
        series,
        checkout.pin.vllm.version,
        load_outcomes(args.base_outcomes),
        load_outcomes(args.overlay_outcomes),
    )
    out = args.out or checkout.unit_base_report
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(encode_report(report))
    app.say(format_table(report, only_named=True))
    red_elsewhere = [r for r in report.rows if not r.patch and r.base != "passed"]
    if red_elsewhere:
        app.say(f"{len(red_elsewhere)} test(s) no patch names also fail on the base:")
        for r in red_elsewhere:
            app.say(f"  {r.test_id}  base={r.base} overlay={r.overlay}")
    problems = gate(report, series)
    for problem in problems:
        app.say(f"gate: {problem}")
    named = sum(1 for r in report.rows if r.patch)
    proven = sum(1 for r in report.rows if r.patch and r.revert_red)
    verdict = "FAILED" if problems else "ok"
    app.say(
        f"revert-red: {verdict}; {proven}/{named} named tests fail on the base and "
        f"pass overlaid; {len(report.rows)} tests in all; report {out}"
    )
    app.result({"ok": not problems, "problems": problems, "report": str(out)})
    return 1 if problems else 0


def register(sub: Subparsers) -> None:
    rr = add_command(sub, "revert-red", cmd_revert_red)
    rr.add_argument("--base-outcomes", type=Path, required=True, metavar="JSON")
    rr.add_argument("--overlay-outcomes", type=Path, required=True, metavar="JSON")
    rr.add_argument(
        "--out",
        type=Path,
        metavar="JSON",
        help="the report (default: .nox-reports/unit-base.json in the checkout)",
    )
