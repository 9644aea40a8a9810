"""``vllm-overlay simulate``: base vs overlay, every prompt length."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import re
import signal
from collections.abc import Callable
from pathlib import Path

import msgspec

from vllm_overlay import safefile
from vllm_overlay.checkout import REPORT_DIR
from vllm_overlay.command import App, Subparsers, add_command
from vllm_overlay.errors import OverlayError
from vllm_overlay.simulate.builds import BuildPair, parse_pairs
from vllm_overlay.simulate.bytes import cli as bytes_cli
from vllm_overlay.simulate.bytes.lifetime import (
    Interrupted,
    die_with_parent_from_env,
    signals_raise,
)
from vllm_overlay.simulate.bytes.verdict import judge as judge_bytes
from vllm_overlay.simulate.core import core_tree
from vllm_overlay.simulate.families import family_layouts
from vllm_overlay.simulate.faults import (
    DEFAULT_FAULT_HITS,
    DEFAULT_FAULT_LENGTHS,
    FAULTS,
    format_faults,
    parse_faults,
)
from vllm_overlay.simulate.layouts import BASE_LAYOUTS, all_layouts, expand
from vllm_overlay.simulate.matrix import (
    MATRIX_JSON,
    format_matrix,
    readme_section,
    replace_section,
)
from vllm_overlay.simulate.plan import (
    DEFAULT_HITS,
    DEFAULT_LENGTHS,
    FAMILY_LENGTHS,
    parse_hits,
    parse_lengths,
)
from vllm_overlay.simulate.procs import SweepOptions
from vllm_overlay.simulate.report import (
    SweepReport,
    format_pairs,
    format_table,
    summary_line,
)
from vllm_overlay.simulate.run import run_sweep
from vllm_overlay.simulate.verdict import (
    GAPS_FILE,
    SIMULATE_REPORT,
    GapsError,
    KnownGap,
    gap_layout,
    judge,
    load_gaps,
)
from vllm_overlay.simulate.writes import MODES, READ, parse_modes
from vllm_overlay.tree.baseopts import add_base_options, base_source
from vllm_overlay.tree.materialize import BaseSource

BYTES_REPORT = "simulate-bytes.json"
DEPRECATED_BYTES = (
    "note: `vllm-overlay simulate --bytes` is deprecated; it runs "
    "`vllm-overlay simulate-bytes` (the same options)"
)
DEFAULT_MODES = ",".join(MODES)
"""Both modes, as ``simulate-bytes``: WRITE is the connector's default."""
DEFAULT_VARIANT = "all"
"""Both builds alone and both mixed pairs (a rolling upgrade's halves)."""


class SimulateArgsError(OverlayError):
    """A --layouts, --lengths or --hits value the simulator cannot use."""


def _check_args(layouts: list[str], lengths: str | None, hits: str | None) -> None:
    checks: list[tuple[str, object, Callable[[], object]]] = [
        ("--layouts", ",".join(layouts), lambda: expand(layouts or None)),
    ]
    if hits is not None:
        checks.append(("--hits", hits, lambda: parse_hits(hits)))
    if lengths is not None:
        checks.append(("--lengths", lengths, lambda: parse_lengths(lengths)))
    for option, value, parse in checks:
        try:
            parse()
        except (ValueError, KeyError) as e:
            why = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise SimulateArgsError(f"{option} {value!r}: {why}") from None


def selection(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The options that chose what runs, where not their default (a run
    without any is the full run): (name, value), in a fixed order."""
    given: list[tuple[str, str]] = [
        ("layouts", args.layouts),
        ("lengths", args.lengths or ""),
        ("hits", args.hits or ""),
        ("variant", "" if args.variant == DEFAULT_VARIANT else args.variant),
        ("faults", args.faults or ""),
        ("overlay-from", "" if args.overlay_from == "series" else args.overlay_from),
        ("whole", "yes" if args.whole else ""),
        ("core", "yes" if args.core else ""),
        ("families", "yes" if args.update_readme else ""),
    ]
    given += [
        (option.removeprefix("--"), "yes" if value is True else str(value))
        for option, value in bytes_cli.given_options(args).items()
    ]
    return [(name, value.strip()) for name, value in given if value.strip()]


class _Wall(msgspec.Struct):
    wall_seconds: float


def previous_wall_seconds(report: Path) -> float | None:
    """The wall time an earlier run wrote into ``report``, if it is there
    and readable."""
    try:
        return msgspec.json.decode(report.read_bytes(), type=_Wall).wall_seconds
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


# A report name stays readable: a longer selection is cut and given a hash.
_NAME_MAX = 80


def report_name(full: str, chosen: list[tuple[str, str]]) -> str:
    """``simulate-bytes.json`` for the full run; a run that chose what runs
    gets a name of its own from its selection, so it never replaces the full
    run's report: ``simulate-bytes.layouts-glm.json``."""
    if not chosen:
        return full
    parts = [name if value == "yes" else f"{name}-{value}" for name, value in chosen]
    slug = re.sub(r"[^A-Za-z0-9.,+=-]", "_", ".".join(parts))
    if len(slug) > _NAME_MAX:
        digest = hashlib.sha256(slug.encode()).hexdigest()[:8]
        slug = f"{slug[: _NAME_MAX - 9]}-{digest}"
    stem, _, ext = full.rpartition(".")
    return f"{stem}.{slug}.{ext}"


def register(sub: Subparsers) -> None:
    p = add_command(sub, "simulate", _run)
    _add_selection(p, own_bytes=False)
    p.add_argument(
        "--faults",
        nargs="?",
        const="all",
        default=None,
        metavar="LIST",
        help="instead of the sweep, drive each per-request refusal path of the "
        "decoder's connector through vLLM's real Scheduler.schedule() with "
        "another request in flight: " + ", ".join(FAULTS) + " (all: every "
        f"refusal path, the default; hook-raises is a self-test); lengths "
        f"default {DEFAULT_FAULT_LENGTHS}, hits {DEFAULT_FAULT_HITS}; fails on "
        "an exception escaping the scheduler unless known-gaps lists it",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print the model-family matrix as the README's Markdown table",
    )
    p.add_argument(
        "--update-readme",
        action="store_true",
        help="run every model family (base and overlay), write "
        f"{MATRIX_JSON} and the README's supported-models table",
    )
    p.add_argument(
        "--whole",
        action="store_true",
        help="run every case through the schedulers (the reference; by default "
        "a case a whole number of periods longer than a small one it matches "
        "follows from it: simulate/shrink.py)",
    )
    bytes_cli.add_arguments(p, own_command=False)
    p.set_defaults(bytes_command=False)
    b = add_command(sub, "simulate-bytes", _run_bytes)
    _add_selection(b, own_bytes=True)
    b.set_defaults(
        faults=None,
        markdown=False,
        update_readme=False,
        whole=False,
        bytes_command=True,
    )
    bytes_cli.add_arguments(b, own_command=True)


def _add_selection(p: argparse.ArgumentParser, *, own_bytes: bool) -> None:
    """The options both simulators take (``own_bytes``: the help of
    ``simulate-bytes``)."""
    p.add_argument(
        "--layouts",
        default="",
        metavar="LIST",
        help="comma list of "
        + ", ".join(all_layouts())
        + " (optionally name/dcpN); default: all, every DCP size they allow",
    )
    lengths = (
        f"{bytes_cli.DEFAULT_LENGTHS}"
        if own_bytes
        else f"{DEFAULT_LENGTHS} for the mechanism layouts, {FAMILY_LENGTHS} for "
        "the model families"
    )
    p.add_argument(
        "--lengths",
        default=None,
        metavar="RANGES",
        help=f"prompt lengths: ranges a-b, a-b/step, lists (default {lengths})",
    )
    p.add_argument(
        "--hits",
        metavar="PERCENTS",
        help="decoder prefix-hit percentages (default "
        f"{bytes_cli.DEFAULT_HITS if own_bytes else DEFAULT_HITS})",
    )
    p.add_argument(
        "--variant",
        default=DEFAULT_VARIANT,
        metavar="PAIRS",
        help="which connector build each leg runs, a comma list of pairs: base, "
        "overlay (one build on both legs), base->overlay (a base prefiller, an "
        "overlaid decoder), overlay->base (a rolling upgrade's two halves); "
        "both = base,overlay; mixed = base->overlay,overlay->base; all = the "
        "four (default: %(default)s; every pair with an overlaid leg is "
        "judged, a base decoder where the base pair reads right"
        + (
            "; the mixed pairs run the mechanism layouts only)"
            if own_bytes
            else "; --update-readme: both)"
        ),
    )
    name = BYTES_REPORT if own_bytes else SIMULATE_REPORT
    p.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help=f"where the JSON report goes (default: {REPORT_DIR}/{name} for "
        "the full run, a name of its own for a selection, in the checkout)",
    )
    add_base_options(p, "the pinned base")
    p.add_argument(
        "--overlay-from",
        default="series",
        metavar="SOURCE",
        help="'series' (this checkout's patches on the base; default), a "
        "directory holding overlaid moriio files, or REPO@REF (a stack branch)",
    )
    p.add_argument(
        "--core",
        action="store_true",
        help="run both legs on vLLM with the core series (patches/core/, "
        "upstream-only) applied",
    )
    p.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="zygotes per variant at a time (default 1)"
        if own_bytes
        else "worker processes per variant (default: cores / variants)",
    )


def _run_bytes(app: App, args: argparse.Namespace) -> int:
    """Byte-level simulator: real MoRIIO workers move real KV bytes, base vs overlay.

    Both legs' real MoRIIO workers (prefill and decode ranks as processes,
    real KV cache tensors in vLLM's layout, the real handshake) move the KV
    over a loopback stand-in for mori, in READ and WRITE mode, for every TP
    pair and KV cache layout, and every byte the decoder attends to is
    checked against what the prefiller computed.

    Ends with a verdict on the overlay: exit status 1 when a configuration
    that starts moves a wrong or stray byte, crashes or runs no case with
    the overlay, unless docs/known-gaps.toml lists it with the issue or
    patch that tracks it.
    """
    return _run(app, args)


def _run(app: App, args: argparse.Namespace) -> int:
    """CPU prefill/decode simulator: real schedulers, content-checked READ and WRITE.

    Run both legs' real vLLM schedulers on CPU with the MoRIIO connector in
    READ and WRITE mode (--modes), base against overlay, for every layout,
    prompt length and decoder prefix hit, and check what the decoder holds
    for its last prompt token once the KV moved. The byte level is
    `vllm-overlay simulate-bytes` (`simulate --bytes` still runs it, with a
    note on stderr).

    Ends with a verdict on the overlay: exit status 1 when a layout that
    starts (in a mode) ends with wrong KV, crashes or runs no case with the
    overlay, unless docs/known-gaps.toml lists it with the issue or patch
    that tracks it.
    """
    if args.processes is not None and args.processes < 1:
        return app.fail(f"--processes {args.processes}: must be at least 1")
    if not args.bytes and (given := bytes_cli.given_without_bytes(args)):
        return app.fail(f"{', '.join(given)}: only with simulate-bytes")
    try:
        variants = [pair.name for pair in parse_pairs(args.variant)]
    except ValueError as e:
        return app.fail(f"--variant {args.variant!r}: {e}")
    try:
        faults = parse_faults(args.faults) if args.faults is not None else None
    except ValueError as e:
        return app.fail(f"--faults {args.faults!r}: {e}")
    if faults and (args.bytes or args.update_readme or args.whole):
        return app.fail("--faults: not with --bytes, --update-readme or --whole")
    try:
        # simulate-bytes checks its own (``bytes_cli.options_from``).
        modes = parse_modes(args.modes) if not args.bytes else list(MODES)
    except ValueError as e:
        return app.fail(f"--modes {args.modes!r}: {e}")
    if (faults or args.update_readme) and args.modes != DEFAULT_MODES:
        return app.fail("--modes: --faults and --update-readme run READ only")
    layouts = [x for x in args.layouts.split(",") if x.strip()]
    _check_args(layouts, args.lengths, args.hits)
    bytes_opts = bytes_cli.options_from(args) if args.bytes else None
    gaps = _gaps(app)
    if args.update_readme:
        if layouts or args.variant != DEFAULT_VARIANT or args.bytes:
            return app.fail("--update-readme runs every family, base and overlay")
        layouts = list(family_layouts())
        variants = ["base", "overlay"]
    name = BYTES_REPORT if args.bytes else SIMULATE_REPORT
    full = app.checkout.root / REPORT_DIR / name
    chosen = selection(args)
    out = args.report or full.with_name(report_name(full.name, chosen))
    options = SweepOptions(
        base_source(args),
        args.overlay_from,
        app.progress,
        app.checkout,
        announce=app.note,
        previous_seconds=previous_wall_seconds(out),
    )
    report: SweepReport | bytes_cli.BytesReport
    with contextlib.ExitStack() as stack:
        if args.core:
            source = options.base_source or BaseSource()
            applied = stack.enter_context(core_tree(source, app.checkout))
            app.say(f"vLLM core: both legs run the core series ({applied})")
        if bytes_opts is not None:
            if not args.bytes_command:  # the arguments are good: say it once
                app.err.write(DEPRECATED_BYTES + "\n")
            try:
                report = _bytes_sweep(bytes_opts, layouts, variants, options)
            except Interrupted as e:
                app.end_progress()
                app.fail(
                    f"simulate-bytes: interrupted by {e}; its zygote and rank "
                    "processes were stopped and their /dev/shm files removed"
                )
                return e.exit_code
            text = bytes_cli.show(report)
            summary = bytes_cli.summary_line(report)
        else:
            hits = args.hits or (DEFAULT_FAULT_HITS if faults else DEFAULT_HITS)
            lengths = args.lengths or (DEFAULT_FAULT_LENGTHS if faults else None)
            report = run_sweep(
                layouts or (list(BASE_LAYOUTS) if faults else []),
                lengths,
                hits,
                variants,
                options,
                args.processes,
                whole=args.whole,
                faults=faults,
                modes=[READ] if args.update_readme else modes,
            )
            text = _scheduler_text(report, args.markdown, bool(faults), variants)
            summary = summary_line(report)
    app.end_progress()
    for variant, where in report.variants.items():
        app.say(f"{variant}: {where}")
    app.say(f"lengths {report.lengths}, hits {report.hits} %")
    if isinstance(report, bytes_cli.BytesReport) and report.family_lengths:
        app.say(f"model families: lengths {report.family_lengths}")
    app.say(text)
    _write_json(out, report)
    if args.report or not chosen:
        app.say(f"report: {out}")
    else:
        app.say(f"report: {out} (this selection's; the full run's is {full.name})")
    if args.update_readme:
        assert isinstance(report, SweepReport)
        _update_readme(app, report)
    app.say(summary)
    if not isinstance(report, SweepReport):
        bytes_verdict = judge_bytes(report, gaps)
        app.say(bytes_verdict.line())
        app.result(report)
        return bytes_verdict.exit_code
    verdict = judge(report, gaps)
    for gap in verdict.passing_gaps:
        app.say(
            f"note: known gap {gap} does not show in this run; remove it from "
            f"{GAPS_FILE} once a full sweep agrees"
        )
    app.say(verdict.line())
    app.result(report)
    return verdict.exit_code


def _scheduler_text(
    report: SweepReport, markdown: bool, faults: bool, variants: list[str]
) -> str:
    """The scheduler sweep's table: the README's matrix (``markdown``), the
    faults' rows, or one row per layout and pair, then by pair of builds
    when a pair is mixed or a layout escaped or fell back."""
    if markdown:
        return format_matrix(report, markdown=True)
    if faults:
        return format_faults(report.faults)
    text = format_table(report)
    if any(BuildPair.parse(v).mixed for v in variants) or any(
        r.escape_cases or r.fallback_cases for r in report.layouts
    ):
        text += "\n\nby pair of builds (prefill->decode):\n" + format_pairs(report)
    return text


def _write_json(path: Path, report: SweepReport | bytes_cli.BytesReport) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = msgspec.json.format(msgspec.json.encode(report))
    safefile.replace_file(path, text + b"\n")


def _update_readme(app: App, report: SweepReport) -> None:
    """``--update-readme``: the matrix's JSON and the README's table."""
    root = app.checkout.root
    _write_json(root / MATRIX_JSON, report)
    readme = root / "README.md"
    readme.write_text(replace_section(readme.read_text(), readme_section(report)))
    app.say(f"wrote {MATRIX_JSON} and the README's supported-models table")


def _bytes_sweep(
    opts: bytes_cli.BytesOptions,
    layouts: list[str],
    variants: list[str],
    options: SweepOptions,
) -> bytes_cli.BytesReport:
    """The byte sweep; SIGINT and SIGTERM stop its processes (and raise
    ``Interrupted``). Started with ``lifetime.PARENT_ENV`` set (by
    ``nox -s simulate-bytes``), it also ends with that parent."""
    die_with_parent_from_env(signal.SIGTERM)
    with signals_raise():
        return bytes_cli.sweep(opts, layouts, variants, options)


def _gaps(app: App) -> list[KnownGap]:
    gaps = load_gaps(app.checkout.root / GAPS_FILE)
    for g in gaps:
        try:
            expand([gap_layout(g)])
        except (KeyError, ValueError) as e:
            raise GapsError(f"{GAPS_FILE}: {g.layout}: {e}") from None
    return gaps
