"""`vllm-overlay apply | status | materialize`: the series on a vLLM tree."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_overlay.command import (
    App,
    Subparsers,
    add_command,
    add_target_option,
)
from vllm_overlay.series.core_series import find_core_patch, load_core_series
from vllm_overlay.series.patch_series import Series, SeriesError, check_series
from vllm_overlay.text import count
from vllm_overlay.tree.apply import apply_series, revert_series
from vllm_overlay.tree.baseopts import add_base_options, base_source
from vllm_overlay.tree.materialize import core_texts, materialize
from vllm_overlay.tree.status import format_status, tree_status
from vllm_overlay.tree.target import Target, detect_target, installed_vllm


def resolve_target(value: Path | None) -> Target:
    return detect_target(value if value is not None else installed_vllm())


def cmd_apply(app: App, args: argparse.Namespace) -> int:
    """Apply the series to a vLLM tree (or --revert it).

    Every pinned file is checked against pin.toml, every hunk must match at
    its exact line, and the files change all together or not at all. A kill
    at any moment leaves a journal: the next `apply` or `apply --revert`
    undoes the cut-short write first, removes leftovers, and repairs a
    missing or stale manifest.
    """
    checkout = app.checkout
    pin = checkout.pin
    target = resolve_target(args.target)
    app.say(f"target: {target.describe()}")
    if args.revert:
        series = _series_for_revert(app)
        outcome = revert_series(target, pin, series, wait=args.wait)
    else:
        # An empty series is the pinned base: applying it reverts.
        problems = check_series(checkout.root, pin, tests=False, allow_empty=True)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise SeriesError(
                f"{problems[0]}{more}; nothing was written (`vllm-overlay series "
                "check` lists every problem)"
            )
        outcome = apply_series(target, pin, checkout.series, wait=args.wait)
    for line in outcome.recovered:
        app.say(f"  first {line}")
    for line in outcome.warnings:
        app.say(f"  warning: {line}")
    for path in outcome.files:
        app.say(f"  wrote {path}")
    app.say(f"{'revert' if args.revert else 'apply'}: {outcome.message}")
    app.result(outcome)
    return 0


def _series_for_revert(app: App) -> Series:
    """The series; when it does not load, none: the tree is then reverted by
    what its manifest records."""
    try:
        return app.checkout.series
    except SeriesError as e:
        app.say(f"  warning: {e}; reverting by the manifest's record")
        return Series(app.checkout.root, ())


def cmd_status(app: App, args: argparse.Namespace) -> int:
    """Base / overlaid / stale / partial / unknown, per pinned file.

    What state a vLLM tree's MoRIIO files are in. Exit status 0 for base or
    overlaid (or the --require state), 1 otherwise.
    """
    pin, series = app.checkout.pin, app.checkout.series
    target = resolve_target(args.target)
    report, _ = tree_status(target, pin, series)
    app.say(format_status(report))
    app.result(report)
    if args.require is not None and report.state != args.require:
        app.say(f"status: --require {args.require}, but the tree is {report.state}")
        return 1
    ok = report.clean and (args.require is None or report.state == args.require)
    return 0 if ok else 1


def cmd_materialize(app: App, args: argparse.Namespace) -> int:
    """Write the overlaid (or base) MoRIIO files into a directory.

    Every pinned MoRIIO file, overlaid (or the base with --base), is written
    below DIR with its path inside vLLM kept. With --core cNNN the core files
    (pin.toml's core_files) are written too, with the core series up to that
    patch applied: the level plugin loads them with --core-dir DIR.
    """
    pin, whole = app.checkout.pin, app.checkout.series
    if args.upto is not None and not 0 <= args.upto <= len(whole.patches):
        raise SeriesError(
            f"--upto {args.upto}: the series has patches 1..{len(whole.patches)} "
            f"(0 for none); nothing was written"
        )
    source = base_source(args)
    extra: dict[str, str] = {}
    if args.core is not None:
        core = load_core_series(app.checkout.root)
        fix = find_core_patch(core, args.core)
        extra = core_texts(source.load_core(pin), core.upto(fix.index))
    bases = source.load(pin, whole)
    series = whole if args.upto is None else whole.upto(args.upto)
    written = materialize(
        {**bases.texts, **extra}, series, args.out, overlay=not args.base
    )
    for path in written:
        app.say(f"  wrote {path}")
    what = _stack_said(whole, series, args.base)
    if args.core is not None:
        what += f", with core patches up to {args.core}"
    app.say(
        f"materialize: {count(len(written), 'file')}, {what}, from {bases.source} "
        f"into {args.out}"
    )
    app.result(
        {
            "files": [str(p) for p in written],
            "series_id": series.series_id,
            "whole_series_id": whole.series_id,
        }
    )
    return 0


def _stack_said(whole: Series, stack: Series, base: bool) -> str:
    """What was written: the base, the whole series, or its first patches.
    Only the whole series' id is named (a stack's own id is in --json)."""
    if base or not stack.patches:
        return "the pinned base"
    if len(stack.patches) == len(whole.patches):
        return f"overlaid by series {whole.series_id}"
    numbers = [p.name.split("-", 1)[0] for p in stack.patches]
    span = numbers[0] if len(numbers) == 1 else f"{numbers[0]}..{numbers[-1]}"
    return (
        f"overlaid by {count(len(numbers), 'patch', 'patches')} {span} of "
        f"series {whole.series_id}"
    )


def register(sub: Subparsers) -> None:
    apply = add_command(sub, "apply", cmd_apply)
    add_target_option(apply)
    apply.add_argument("--revert", action="store_true", help="restore the pinned base")
    apply.add_argument(
        "--wait",
        action="store_true",
        help="wait for another apply on the same tree instead of failing",
    )

    status = add_command(sub, "status", cmd_status)
    add_target_option(status)
    status.add_argument(
        "--require",
        choices=["base", "overlaid"],
        default=None,
        help="exit non-zero unless the whole tree is in this state",
    )

    mat = add_command(sub, "materialize", cmd_materialize)
    mat.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="where to write"
    )
    add_base_options(mat, "the base files")
    mat.add_argument("--base", action="store_true", help="write the base files")
    mat.add_argument(
        "--upto", type=int, metavar="N", help="apply the first N patches only (0: none)"
    )
    mat.add_argument(
        "--core",
        metavar="cNNN",
        help="also write the core files, with patches/core/ up to cNNN applied",
    )
