"""``vllm-overlay simulate``: base vs overlay, every prompt length."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from vllm_overlay.simulate.layouts import BASE_LAYOUTS
from vllm_overlay.simulate.report import format_table, summary_line
from vllm_overlay.simulate.run import DEFAULT_HITS, DEFAULT_LENGTHS, run_sweep


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="CPU prefill/decode simulator: real schedulers, content-checked READ",
    )
    p.add_argument(
        "--layouts",
        default="",
        help="comma list of "
        + ", ".join(BASE_LAYOUTS)
        + " (optionally name/dcpN); default: all, every DCP size they allow",
    )
    p.add_argument(
        "--lengths",
        default=DEFAULT_LENGTHS,
        help="prompt lengths: ranges a-b, a-b/step, lists (default %(default)s)",
    )
    p.add_argument(
        "--hits",
        default=DEFAULT_HITS,
        help="decoder prefix-hit percentages (default %(default)s)",
    )
    p.add_argument("--variant", choices=("base", "overlay", "both"), default="both")
    p.add_argument("--json", type=Path, help="also write the report as JSON here")
    p.add_argument(
        "--base-from",
        type=Path,
        help="the pinned wheel or a vLLM tree (base or a known overlay) "
        "(default: $VLLM_OVERLAY_WHEEL, else the installed vLLM)",
    )
    p.add_argument(
        "--overlay-from",
        default="series",
        help="'series' (this checkout's patches on the base; default), a "
        "directory holding overlaid moriio files, or REPO@REF (a stack branch)",
    )
    p.add_argument(
        "--processes",
        type=int,
        help="worker processes per variant (default: cores / variants)",
    )
    p.set_defaults(func=_run)


def _progress(line: str) -> None:
    sys.stderr.write("\r\x1b[K" + line[:150])
    sys.stderr.flush()


def _run(args: argparse.Namespace) -> int:
    variants = ["base", "overlay"] if args.variant == "both" else [args.variant]
    layouts = [x for x in args.layouts.split(",") if x.strip()]
    report = run_sweep(
        layouts,
        args.lengths,
        args.hits,
        variants,
        base_source=args.base_from,
        overlay_source=args.overlay_from,
        processes_per_variant=args.processes,
        progress=_progress,
    )
    sys.stderr.write("\r\x1b[K")
    for variant, where in report.variants.items():
        print(f"{variant}: {where}")
    print(f"lengths {report.lengths}, hits {report.hits} %")
    print(format_table(report))
    if args.json is not None:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    print(summary_line(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-overlay")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
