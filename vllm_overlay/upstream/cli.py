"""`vllm-overlay export | rebase`: the series toward and from upstream vLLM."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vllm_overlay.command import App, Subparsers, add_command
from vllm_overlay.tree.materialize import base_from_target, base_from_wheel
from vllm_overlay.tree.target import detect_target, installed_vllm
from vllm_overlay.upstream.export import (
    DEFAULT_OUT,
    RUFF_VERSION,
    export,
    load_context,
)
from vllm_overlay.upstream.rebase import (
    DEFAULT_CACHE,
    DEFAULT_WORKDIR,
    encode_report,
    format_table,
    rebase_plan,
    resolve_new_base,
    write_plan,
)


def cmd_export(app: App, args: argparse.Namespace) -> int:
    root = app.checkout.root
    wheel = args.wheel
    if wheel is None and os.environ.get("VLLM_OVERLAY_WHEEL"):
        wheel = Path(os.environ["VLLM_OVERLAY_WHEEL"])
    ctx = load_context(
        root, wheel=wheel, source=args.source, ruff=args.ruff, run_tests=args.run_tests
    )
    out = app.checkout.path(args.out)
    written = export(ctx, args.patch or [], out)
    for path in written:
        if path.name == "checks.log":
            app.say(path.read_text().rstrip("\n"))
        app.say(f"  wrote {path}")
    app.say(f"export: {len(written) // 3} bundle(s) in {out}")
    app.result({"out": str(out), "files": [str(p) for p in written]})
    return 0


def cmd_rebase(app: App, args: argparse.Namespace) -> int:
    checkout = app.checkout
    pin, series = checkout.pin, checkout.series
    if args.old_wheel is not None:
        old_bases = base_from_wheel(args.old_wheel, pin)
    else:
        target = detect_target(args.old if args.old is not None else installed_vllm())
        old_bases = base_from_target(target, pin, series)
    new = resolve_new_base(args.to, pin.module, args.cache)
    workdir = checkout.path(args.workdir) / new.version
    report, plan = rebase_plan(
        pin, series, old_bases, new, workdir, git_commit=args.git_commit
    )
    if plan is not None and args.write:
        for path in write_plan(checkout.root, plan):
            app.say(f"  wrote {path}" if path.exists() else f"  removed {path}")
        report.written = True
    app.say(format_table(report))
    report_path = args.report or workdir / "rebase.json"
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_bytes(encode_report(report))
    app.say(f"rebase: report written to {report_path}")
    app.result(report)
    if plan is None:
        app.say("rebase: not every patch applies; nothing in the repository changed")
        return 1
    if not args.write:
        app.say("rebase: every patch applies or is upstream; --write updates the pin")
    return 0


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "export",
        cmd_export,
        help="upstream-ready patch mails and PR bodies under dist/upstream",
        description=(
            "Write each patch as a `git format-patch` mail with its tests ported "
            "to vLLM's layout, and its pull-request body, after checking it "
            "applies, is proven by the unit-base report and passes vLLM's ruff."
        ),
    )
    p.add_argument(
        "--patch",
        action="append",
        metavar="NAME",
        help="a patch name or slug (repeat; default: every patch)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help="where the bundles go (default: %(default)s in the checkout)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--wheel",
        type=Path,
        metavar="WHEEL",
        help="the pinned wheel (default: $VLLM_OVERLAY_WHEEL, else this Python's vllm)",
    )
    src.add_argument(
        "--from",
        dest="source",
        type=Path,
        metavar="DIR",
        help="a vLLM tree holding the base or a known overlay",
    )
    p.add_argument("--ruff", metavar="PATH", help=f"the ruff {RUFF_VERSION} executable")
    p.add_argument(
        "--run-tests",
        action="store_true",
        help="also run each ported test file alone (this Python's vLLM overlaid)",
    )

    p = add_command(
        sub,
        "rebase",
        cmd_rebase,
        help="classify and move the series onto a newer vLLM base",
        description=(
            "Classify every patch against a newer vLLM (clean, offset, upstream, "
            "conflict, blocked); with --write and no conflict, write the new pin "
            "and the refreshed patches."
        ),
    )
    p.add_argument(
        "--to",
        required=True,
        metavar="VERSION|WHEEL|DIR",
        help="the new base: a vLLM version (fetched with pip), a wheel, a source tree",
    )
    old = p.add_mutually_exclusive_group()
    old.add_argument(
        "--from",
        dest="old",
        type=Path,
        metavar="DIR",
        help="the tree holding the pinned base (default: this Python's vllm)",
    )
    old.add_argument(
        "--old-wheel", type=Path, metavar="WHEEL", help="the pinned wheel, as old base"
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=DEFAULT_WORKDIR,
        metavar="DIR",
        help="conflicts and the report go here (default: %(default)s)",
    )
    p.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help="the report file (default: WORKDIR/VERSION/rebase.json)",
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=DEFAULT_CACHE,
        metavar="DIR",
        help="where fetched wheels are kept (default: %(default)s)",
    )
    p.add_argument(
        "--git-commit",
        default="",
        metavar="SHA",
        help="the new base's vLLM commit, if not recorded",
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="write the new pin and refreshed patches (only if all apply)",
    )
