"""`vllm-overlay`: the command line of the overlay."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.gate.outcomes import load_outcomes
from vllm_overlay.gate.reports import encode_report, unit_base_report_path
from vllm_overlay.gate.revert_red import build_report, format_table, gate
from vllm_overlay.series.patch_series import (
    PATCH_DIR,
    SERIES_FILE,
    Series,
    SeriesError,
    load_series,
)
from vllm_overlay.series.patch_series import check_series as run_series_check
from vllm_overlay.series.pin import PIN_FILE, Pin, load_pin
from vllm_overlay.tree.apply import apply_series, revert_series
from vllm_overlay.tree.materialize import (
    base_from_target,
    base_from_wheel,
    materialize,
)
from vllm_overlay.tree.status import format_status, tree_status
from vllm_overlay.tree.target import Target, detect_target, installed_vllm


def find_repo(start: Path | None = None) -> Path:
    """The overlay checkout: the nearest directory above ``start`` (the
    working directory) holding the pin and the series, else this package's."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / PIN_FILE).is_file() and (d / PATCH_DIR / SERIES_FILE).is_file():
            return d
    pkg_root = Path(__file__).resolve().parents[1]
    if (pkg_root / PIN_FILE).is_file():
        return pkg_root
    raise SeriesError(
        f"no overlay checkout found above {here} (looked for {PIN_FILE} and "
        f"{PATCH_DIR}/{SERIES_FILE}); pass --repo"
    )


def load_repo(args: argparse.Namespace) -> tuple[Path, Pin, Series]:
    repo = args.repo or find_repo()
    return repo, load_pin(repo / PIN_FILE), load_series(repo)


def resolve_target(value: Path | None) -> Target:
    return detect_target(value if value is not None else installed_vllm())


def cmd_series_check(args: argparse.Namespace) -> int:
    repo = args.repo or find_repo()
    pin = load_pin(repo / PIN_FILE)
    problems = run_series_check(repo, pin)
    for problem in problems:
        print(f"error: {problem}")
    if problems:
        print(f"series check: {len(problems)} problem(s)")
        return 1
    series = load_series(repo)
    for p in series.patches:
        files = ", ".join(Path(f.path).name for f in p.files)
        tests = len(p.header.tests)
        print(f"  {p.index:>2}  {p.name}  ({files}; {tests} test ids)")
    print(f"series check: ok, {len(series.patches)} patches, series {series.series_id}")
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    _, pin, series = load_repo(args)
    target = resolve_target(args.target)
    print(f"target: {target.describe()}")
    if args.revert:
        outcome = revert_series(target, pin, series)
    else:
        outcome = apply_series(target, pin, series)
    for path in outcome.files:
        print(f"  wrote {path}")
    print(f"{'revert' if args.revert else 'apply'}: {outcome.message}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    _, pin, series = load_repo(args)
    target = resolve_target(args.target)
    report, _ = tree_status(target, pin, series)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(report)).decode())
        sys.stdout.write("\n")
    else:
        print(format_status(report))
    if args.require is not None:
        return 0 if report.state == args.require else 1
    return 0 if report.state in ("base", "overlaid") else 1


def cmd_materialize(args: argparse.Namespace) -> int:
    _, pin, series = load_repo(args)
    if args.wheel is not None:
        source = f"wheel {args.wheel}"
        bases = base_from_wheel(args.wheel, pin)
    else:
        target = resolve_target(args.source)
        source = target.describe()
        bases = base_from_target(target, pin, series)
    if args.upto is not None:
        if not 0 <= args.upto <= len(series.patches):
            raise SeriesError(f"--upto must be 0..{len(series.patches)}")
        series = series.upto(args.upto)
    written = materialize(bases, series, args.out, overlay=not args.base)
    for path in written:
        print(f"  wrote {path}")
    what = "base" if args.base else f"overlaid (series {series.series_id})"
    print(f"materialize: {len(written)} {what} files from {source} into {args.out}")
    return 0


def cmd_revert_red(args: argparse.Namespace) -> int:
    repo, pin, series = load_repo(args)
    report = build_report(
        series,
        pin.vllm.version,
        load_outcomes(args.base_outcomes),
        load_outcomes(args.overlay_outcomes),
    )
    out = args.out or unit_base_report_path(repo)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(encode_report(report))
    print(format_table(report, only_named=True))
    red_elsewhere = [r for r in report.rows if not r.patch and r.base != "passed"]
    if red_elsewhere:
        print(f"{len(red_elsewhere)} test(s) no patch names also fail on the base:")
        for r in red_elsewhere:
            print(f"  {r.test_id}  base={r.base} overlay={r.overlay}")
    problems = gate(report, series)
    for problem in problems:
        print(f"gate: {problem}")
    named = sum(1 for r in report.rows if r.patch)
    proven = sum(1 for r in report.rows if r.patch and r.revert_red)
    verdict = "FAILED" if problems else "ok"
    print(
        f"revert-red: {verdict}; {proven}/{named} named tests fail on the base and "
        f"pass overlaid; {len(report.rows)} tests in all; report {out}"
    )
    return 1 if problems else 0


Register = Callable[[argparse._SubParsersAction], None]


def _extensions() -> list[Register]:
    """Subcommands that live in their own modules."""
    registers: list[Register] = []
    for module in (
        "vllm_overlay.upstream.export",
        "vllm_overlay.upstream.rebase",
        "vllm_overlay.simulate.cli",
        "vllm_overlay.image.build",
        "vllm_overlay.e2e.cli",
    ):
        try:
            mod = __import__(module, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name is not None and module.startswith(e.name):
                continue
            raise
        registers.append(mod.register)
    return registers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-overlay",
        description="Apply, check and maintain the MoRIIO patch series on vLLM.",
    )
    parser.add_argument(
        "--repo", type=Path, default=None, help="the overlay checkout (default: found)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    series = sub.add_parser("series", help="the patch series")
    series_sub = series.add_subparsers(dest="series_command", required=True)
    check = series_sub.add_parser("check", help="check the series and its headers")
    check.set_defaults(func=cmd_series_check)

    target_help = (
        "an installed vllm package dir or a vLLM source root "
        "(default: this Python's vllm)"
    )
    apply = sub.add_parser("apply", help="apply the series to a vLLM tree")
    apply.add_argument("--target", type=Path, default=None, help=target_help)
    apply.add_argument("--revert", action="store_true", help="restore the pinned base")
    apply.set_defaults(func=cmd_apply)

    status = sub.add_parser("status", help="base / overlaid / unknown, per pinned file")
    status.add_argument("--target", type=Path, default=None, help=target_help)
    status.add_argument("--json", action="store_true", help="machine-readable report")
    status.add_argument(
        "--require",
        choices=["base", "overlaid"],
        default=None,
        help="exit non-zero unless the whole tree is in this state",
    )
    status.set_defaults(func=cmd_status)

    mat = sub.add_parser("materialize", help="write the overlaid (or base) files")
    mat.add_argument("--out", type=Path, required=True)
    src = mat.add_mutually_exclusive_group()
    src.add_argument("--from", dest="source", type=Path, default=None, help=target_help)
    src.add_argument("--wheel", type=Path, default=None, help="the pinned vLLM wheel")
    mat.add_argument("--base", action="store_true", help="write the base files")
    mat.add_argument("--upto", type=int, default=None, help="apply the first N only")
    mat.set_defaults(func=cmd_materialize)

    rr = sub.add_parser(
        "revert-red", help="compare a base and an overlay test run (unit-base)"
    )
    rr.add_argument("--base-outcomes", type=Path, required=True)
    rr.add_argument("--overlay-outcomes", type=Path, required=True)
    rr.add_argument("--out", type=Path, default=None, help="the JSON report")
    rr.set_defaults(func=cmd_revert_red)

    for register in _extensions():
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except OverlayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
