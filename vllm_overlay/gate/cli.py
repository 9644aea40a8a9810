"""`vllm-overlay levels` and `vllm-overlay revert-red`: the proof that each
patch's tests need it, on the stack below it."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from vllm_overlay.command import (
    App,
    Subparsers,
    add_base_options,
    add_command,
    base_source,
)
from vllm_overlay.errors import OverlayError
from vllm_overlay.gate.outcomes import load_outcomes
from vllm_overlay.gate.reports import TestOutcome, encode_report
from vllm_overlay.gate.revert_red import (
    build_report,
    format_table,
    gate,
    series_level_note,
)
from vllm_overlay.gate.stack import LEVEL_OUTCOMES, level_plan, run_levels
from vllm_overlay.series.patch_series import Series


def cmd_levels(app: App, args: argparse.Namespace) -> int:
    """Run each patch's named tests on the stack levels between base and series.

    For each level K between the pinned base and the whole series (patches
    1..K applied), write the MoRIIO files once and run there, with vLLM's
    MoRIIO package loaded from them, the tests that patch K and patch K+1
    name (Tests and Guards). The outcomes go to OUT/outcomes-level-K.json
    for `revert-red --levels OUT`.
    """
    checkout = app.checkout
    series = checkout.series
    bases = base_source(args).load(checkout.pin, series)
    plan = level_plan(series)
    app.say(
        f"levels: {len(plan)} intermediate stack levels of series "
        f"{series.series_id}, base files from {bases.source}"
    )
    written = run_levels(
        checkout.root,
        checkout.pin,
        series,
        bases.texts,
        args.out,
        pytest_args=shlex.split(args.pytest_args),
        progress=app.say,
    )
    app.say(f"levels: {len(written)} levels run; outcomes in {args.out}")
    app.result({k: str(path) for k, path in written.items()})
    return 0


class LevelsError(OverlayError):
    """A stack level's outcomes are missing."""


def _level_outcomes(
    series: Series, directory: Path
) -> dict[int, dict[str, TestOutcome]]:
    levels = {}
    for k in level_plan(series):
        path = directory / LEVEL_OUTCOMES.format(k=k)
        if not path.is_file():
            raise LevelsError(
                f"{path}: no outcomes for stack level {k}; run `vllm-overlay "
                f"levels --out {directory}` first"
            )
        levels[k] = load_outcomes(path)
    return levels


def cmd_revert_red(app: App, args: argparse.Namespace) -> int:
    """Gate on the unit-base runs: each patch proven on the stack below it.

    Read the outcomes of the suite on the pinned base and with the whole
    series, and (--levels) of each patch's named tests on the stack levels in
    between. Every test in a patch's Tests header must fail on the stack
    below the patch and pass with it; every test in its Guards must pass on
    both. Prints the per-patch table and writes the report export reads.
    """
    checkout = app.checkout
    series = checkout.series
    levels = _level_outcomes(series, args.levels) if args.levels else None
    report = build_report(
        series,
        checkout.pin.vllm.version,
        base=load_outcomes(args.base_outcomes),
        overlay=load_outcomes(args.overlay_outcomes),
        levels=levels,
    )
    out = args.out or checkout.unit_base_report
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(encode_report(report))
    app.say(format_table(report))
    note = series_level_note(report)
    if note:
        app.say(note)
    problems = gate(report, series)
    for problem in problems:
        app.say(f"gate: {problem}")
    tests = [r for r in report.stack if r.role == "test"]
    guards = [r for r in report.stack if r.role == "guard"]
    verdict = "FAILED" if problems else "ok"
    app.say(
        f"revert-red: {verdict}; {sum(r.holds for r in tests)}/{len(tests)} named "
        "tests fail on the stack below their patch and pass with it, "
        f"{sum(r.holds for r in guards)}/{len(guards)} guards pass on both; "
        f"{len(report.rows)} tests in all; report {out}"
    )
    app.result({"ok": not problems, "problems": problems, "report": str(out)})
    return 1 if problems else 0


def register(sub: Subparsers) -> None:
    lv = add_command(sub, "levels", cmd_levels)
    lv.add_argument("--out", type=Path, required=True, metavar="DIR", help="outcomes")
    lv.add_argument(
        "--pytest-args",
        default="",
        metavar="ARGS",
        help="more pytest arguments for every level",
    )
    add_base_options(lv, "the pinned base files")
    rr = add_command(sub, "revert-red", cmd_revert_red)
    rr.add_argument("--base-outcomes", type=Path, required=True, metavar="JSON")
    rr.add_argument("--overlay-outcomes", type=Path, required=True, metavar="JSON")
    rr.add_argument(
        "--levels",
        type=Path,
        metavar="DIR",
        help="outcomes of the stack levels in between (`vllm-overlay levels`)",
    )
    rr.add_argument(
        "--out",
        type=Path,
        metavar="JSON",
        help="the report (default: .nox-reports/unit-base.json in the checkout)",
    )
