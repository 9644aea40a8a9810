"""``vllm-overlay simulate-bytes``: both legs' real MoRIIO workers moving
real KV cache tensors over the loopback ``mori`` stand-in, base vs overlay
(the output is ``simulate/cli.py``'s, shared with the scheduler simulator)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import msgspec

from vllm_overlay.command import UsageError
from vllm_overlay.simulate.builds import BuildPair
from vllm_overlay.simulate.bytes.report import (
    BytesReport,
    ConfigItem,
    findings,
    format_fault_table,
    format_pairs,
    format_table,
    summary_line,
)
from vllm_overlay.simulate.bytes.run import (
    DEFAULT_FAMILY_LENGTHS,
    DEFAULT_FAMILY_TP_LENGTHS,
    DEFAULT_HITS,
    DEFAULT_LENGTHS,
    FAMILY_TP_CHOICES,
    FAMILY_TP_PAIRS,
    KV_LAYOUTS,
    MODES,
    TP_PAIRS,
    ZYGOTES,
    FamilyTP,
    parse_tp_pairs,
    plan_items,
    run_bytes_sweep,
)
from vllm_overlay.simulate.bytes.steps import TRANSPORT
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.simulate.procs import SweepOptions

__all__ = [
    "DEFAULT_HITS",
    "DEFAULT_LENGTHS",
    "BytesOptions",
    "BytesReport",
    "add_arguments",
    "options_from",
    "given_without_bytes",
    "show",
    "summary_line",
    "sweep",
]


def add_arguments(p: argparse.ArgumentParser, *, own_command: bool) -> None:
    """The byte sweep's options: on ``simulate-bytes`` (``own_command``), or
    on ``simulate`` behind the deprecated ``--bytes``."""
    if own_command:
        p.set_defaults(bytes=True)
        only = ""
    else:
        p.add_argument(
            "--bytes",
            action="store_true",
            help="deprecated: runs `vllm-overlay simulate-bytes` (the same "
            "options), with a note on stderr",
        )
        only = "--bytes: "
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        metavar="LIST",
        help="the connector's modes: read, write or both (default %(default)s)"
        + ("" if own_command else "; --faults and --update-readme run read"),
    )
    p.add_argument(
        "--tp",
        default=None,
        metavar="PAIRS",
        help=only
        + "prefill-decode TP pairs (default "
        + ",".join(f"{p}-{d}" for p, d in TP_PAIRS)
        + " for the mechanism layouts, "
        + ",".join(f"{p}-{d}" for p, d in FAMILY_TP_PAIRS)
        + " for the model families, each with one unequal pair: --family-tp)",
    )
    p.add_argument(
        "--family-tp",
        default="sample",
        choices=FAMILY_TP_CHOICES,
        help=only + "without --tp, the model families' TP pairs: sample (default: "
        "TP 1->1, and one unequal pair, 1->2 and 2->1 alternating over the "
        f"families, at lengths {DEFAULT_FAMILY_TP_LENGTHS}) or all (every "
        "pair of the mechanism layouts at the families' lengths)",
    )
    p.add_argument(
        "--all-hits",
        action="store_true",
        help=only + "every prompt length at every decoder prefix hit in every "
        "configuration (default: the mechanism layouts at TP 1->1 and with DCP; "
        "the other TP pairs and every model family run each length at one hit, "
        "in turn)",
    )
    if own_command:
        p.add_argument(
            "--faults",
            dest="transport_faults",
            nargs="?",
            const="all",
            default=None,
            metavar="LIST",
            help="instead of the sweep, fault the loopback transport under one "
            "request with another in flight: "
            + ", ".join(FAULT_KINDS)
            + " (drop, late: WRITE only; all: every one, the default; lie, a "
            "self-test: a transfer cut short reports success; abort, WRITE "
            "only: the decoder aborts the request while it waits for its "
            "WRITE); layouts default "
            f"{FAULT_LAYOUTS}, TP {_pairs_text(FAULT_TP)}, lengths "
            f"{FAULT_LENGTHS}, KV layout {FAULT_KV_LAYOUT}; hit 0 only",
        )
    p.add_argument(
        "--kv-layouts",
        default=",".join(KV_LAYOUTS),
        metavar="LIST",
        help=only + "vLLM KV cache layouts (default %(default)s)",
    )


FAULT_KINDS = ("error", "hang", "partial", "drop", "late")
"""The loopback transport's faults (the stand-in's ``FAULT_KINDS``)."""
FAULT_SELF_TESTS = ("lie",)
"""Faults the judge must fail: a transfer cut short that reports success."""
FAULT_ABORT = "abort"
"""Not a transport fault (the transport is left alone), and not in ``all``:
the client aborts the faulted request on the decoder while it waits for
its WRITE."""
WRITE_ONLY_FAULTS = ("drop", "late", FAULT_ABORT)
"""Faults of the prefiller's posted WRITEs: a READ ends within its step."""
FAULT_LAYOUTS = "llama,gemma,kimi,glm"
FAULT_TP = ((1, 1), (1, 2))
FAULT_LENGTHS = "17,129"
FAULT_HITS = "0"
FAULT_KV_LAYOUT = "LBNHC"


def _pairs_text(pairs: tuple[tuple[int, int], ...]) -> str:
    return ",".join(f"{p}-{d}" for p, d in pairs)


def parse_fault_kinds(text: str) -> tuple[str, ...]:
    """``all`` or a comma list of ``FAULT_KINDS``."""
    kinds = tuple(x.strip() for x in text.split(",") if x.strip())
    if kinds in ((), ("all",)):
        return FAULT_KINDS
    known = (*FAULT_KINDS, *FAULT_SELF_TESTS, FAULT_ABORT)
    bad = [k for k in kinds if k not in known]
    if bad:
        raise UsageError(f"--faults: unknown {bad}; choose from {list(known)}")
    return kinds


def fault_items(
    kinds: tuple[str, ...],
    layouts: list[str],
    modes: list[str],
    tp_pairs: list[tuple[int, int]] | None,
    kv_layouts: list[str],
) -> list[ConfigItem]:
    """Every fault x configuration: each length at every hit, ``drop``,
    ``late`` and ``abort`` in WRITE only (the prefiller posts WRITEs; a READ
    ends within its step)."""
    items = plan_items(
        layouts, modes, tp_pairs or list(FAULT_TP), kv_layouts, all_hits=True
    )
    return [
        msgspec.structs.replace(item, fault=f"{TRANSPORT}{kind}")
        for kind in kinds
        for item in items
        if kind not in WRITE_ONLY_FAULTS or item.mode == "write"
    ]


def given_options(args: argparse.Namespace) -> dict[str, str | bool]:
    """The ``--bytes`` options given other than at their default, with
    their values."""
    given: dict[str, str | bool] = {
        "--modes": args.modes if args.modes != ",".join(MODES) else False,
        "--tp": args.tp if args.tp is not None else False,
        "--kv-layouts": (
            args.kv_layouts if args.kv_layouts != ",".join(KV_LAYOUTS) else False
        ),
        "--all-hits": bool(args.all_hits),
        "--family-tp": args.family_tp if args.family_tp != "sample" else False,
    }
    return {name: value for name, value in given.items() if value}


def given_without_bytes(args: argparse.Namespace) -> list[str]:
    """The ``--bytes`` options a command line without ``--bytes`` gives
    (``--modes`` is the scheduler simulator's too)."""
    return [option for option in given_options(args) if option != "--modes"]


@dataclass(frozen=True)
class BytesOptions:
    """What a byte sweep runs, checked (``options_from``)."""

    modes: tuple[str, ...]
    kv_layouts: tuple[str, ...]
    tp_pairs: tuple[tuple[int, int], ...] | None
    """None: each layout's default (``TP_PAIRS``, ``FAMILY_TP_PAIRS``)."""
    all_hits: bool = False
    family_tp: FamilyTP = "sample"
    """``FAMILY_TP_CHOICES``: what the model families run without ``--tp``."""
    lengths: str | None = None
    """``--lengths`` (None: ``DEFAULT_LENGTHS``, the families their own)."""
    hits: str | None = None
    zygotes: int = ZYGOTES
    faults: tuple[str, ...] | None = None
    """``--faults``: the transport faults to run instead of the sweep."""


def options_from(args: argparse.Namespace) -> BytesOptions:
    """The byte sweep's options from the command line; a bad ``--modes``,
    ``--kv-layouts`` or ``--tp`` is a one-line ``UsageError``."""
    modes = tuple(x for x in args.modes.split(",") if x.strip())
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UsageError(f"--modes: unknown {bad}; choose from {list(MODES)}")
    kv_layouts = tuple(x.strip() for x in args.kv_layouts.split(",") if x.strip())
    bad = [k for k in kv_layouts if k not in KV_LAYOUTS]
    if bad or not kv_layouts:
        raise UsageError(f"--kv-layouts: unknown {bad}; choose from {list(KV_LAYOUTS)}")
    try:
        tp_pairs = tuple(parse_tp_pairs(args.tp)) if args.tp else None
    except ValueError as exc:
        raise UsageError(
            f"--tp {args.tp!r}: want PREFILL-DECODE pairs of positive integers, "
            "e.g. 1-1,2-1"
        ) from exc
    faults = (
        parse_fault_kinds(args.transport_faults)
        if getattr(args, "transport_faults", None) is not None
        else None
    )
    if faults is not None and "write" not in modes:
        write_only = [k for k in faults if k in WRITE_ONLY_FAULTS]
        if write_only and faults != FAULT_KINDS:
            raise UsageError(
                f"--faults {', '.join(write_only)}: WRITE only, and --modes "
                f"{','.join(modes)} runs no WRITE"
            )
    return BytesOptions(
        modes,
        kv_layouts,
        tp_pairs,
        all_hits=bool(args.all_hits),
        family_tp=args.family_tp,
        lengths=args.lengths,
        hits=args.hits,
        zygotes=getattr(args, "processes", None) or ZYGOTES,
        faults=faults,
    )


def sweep(
    opts: BytesOptions,
    layouts: list[str],
    variants: list[str],
    options: SweepOptions,
) -> BytesReport:
    if opts.faults is not None:
        if opts.hits not in (None, FAULT_HITS):
            raise UsageError("--faults: runs hit 0 only (no decoder warm-up)")
        kv = (
            list(opts.kv_layouts)
            if opts.kv_layouts != KV_LAYOUTS
            else [FAULT_KV_LAYOUT]
        )
        try:
            items = fault_items(
                opts.faults,
                layouts or FAULT_LAYOUTS.split(","),
                list(opts.modes),
                list(opts.tp_pairs) if opts.tp_pairs is not None else None,
                kv,
            )
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        return run_bytes_sweep(
            items,
            opts.lengths or FAULT_LENGTHS,
            FAULT_HITS,
            variants,
            options,
            opts.zygotes,
        )
    try:
        items = plan_items(
            layouts or [layout.name for layout in expand()],
            list(opts.modes),
            list(opts.tp_pairs) if opts.tp_pairs is not None else None,
            list(opts.kv_layouts),
            None if opts.lengths else DEFAULT_FAMILY_LENGTHS,
            all_hits=opts.all_hits,
            family_tp=opts.family_tp,
            sample_lengths=None if opts.lengths else DEFAULT_FAMILY_TP_LENGTHS,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    lengths, hits = opts.lengths or DEFAULT_LENGTHS, opts.hits or DEFAULT_HITS
    return run_bytes_sweep(items, lengths, hits, variants, options, opts.zygotes)


def show(report: BytesReport) -> str:
    """The table, then every configuration with wrong bytes."""
    if any(r.item.fault for r in report.configs):
        return format_fault_table(report)
    found = findings(report)
    text = format_table(report) + (
        "\n\nwrong bytes:\n" + "\n".join(found) if found else ""
    )
    if any(BuildPair.parse(v).mixed for v in report.variants) or any(
        r.escape_cases for r in report.configs
    ):
        text += "\n\nby pair of builds (prefill->decode):\n" + format_pairs(report)
    return text
