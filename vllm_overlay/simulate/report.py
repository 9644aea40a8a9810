"""Report structs (cross the worker process boundary and --json) and table."""

from __future__ import annotations

import msgspec

from vllm_overlay.simulate.check import CaseResult
from vllm_overlay.simulate.faults import FaultReport
from vllm_overlay.simulate.lines import Progress, count_case
from vllm_overlay.simulate.tables import TABLE_WIDTH, clip, ratio, table
from vllm_overlay.simulate.writes import MODES, READ, Mode, row_key
from vllm_overlay.text import count


class LayoutReport(msgspec.Struct, tag="layout"):
    variant: str
    layout: str
    note: str
    family: str = ""
    """Model family (empty for the mechanism layouts)."""
    source: str = ""
    """The vLLM code whose spec construction the layout follows."""
    mode: Mode = READ
    """The connector's mode the row ran (``writes.py``): the decoder READs
    or the prefiller WRITEs; the same checks either way (``pages_read``:
    the pages moved)."""
    lengths_tried: int = 0
    cases: int = 0
    refused_at_start: str | None = None
    refused_by: str | None = None
    """``connector`` (MoRIIO fails closed) or ``vllm`` (vLLM itself)."""
    wrong_cases: int = 0
    wrong_lengths: list[int] = []
    """Lengths with wrong KV at any hit fraction, ascending."""
    wrong_lengths_by_hit: dict[str, list[int]] = {}
    error_cases: int = 0
    first_errors: list[str] = []
    pages_read: int = 0
    min_pages: int = 0
    bytes_read: int = 0
    min_bytes: int = 0
    extra_reads: int = 0
    duplicate_reads: int = 0
    unread: int = 0
    null_reads: int = 0
    escape_cases: int = 0
    """Cases whose exception left a leg's ``Scheduler.schedule()`` or
    ``update_from_output()`` (a server's engine dies; also in
    ``error_cases``)."""
    fallback_cases: int = 0
    """Cases the decoder served by local prefill instead of a transfer."""
    sampled_drafter_rows: int = 0
    """Drafter rows read that the prefiller computed from its own sampled
    token instead of the prompt's (``CaseResult.sampled_drafter_rows``)."""
    sampled_drafter_cases: int = 0
    seconds: float = 0.0
    cases_run: int = 0
    """Cases run through the schedulers (fewer than ``cases`` when most
    follow from small ones, ``shrink.py``)."""
    period: int = 0
    """The period the cases were shrunk by (0: every case ran whole)."""
    run_cost: int = 0
    """A case's fixed cost in prompt tokens' worth, as measured for the
    shrinking (``shrink.calibrate``; 0: not measured, because every case ran
    whole or no case could follow from small ones)."""

    def add(self, result: CaseResult) -> None:
        self.escape_cases += result.escaped
        if count_case(self, result.error):
            return
        self.fallback_cases += result.fallback
        self.sampled_drafter_rows += result.sampled_drafter_rows
        self.sampled_drafter_cases += result.sampled_drafter_rows > 0
        key = f"{result.hit_fraction * 100:g}"
        if result.wrong:
            self.wrong_cases += 1
            self.wrong_lengths_by_hit.setdefault(key, []).append(result.n)
        self.pages_read += result.pages_read
        self.min_pages += result.min_pages
        self.bytes_read += result.bytes_read
        self.min_bytes += result.min_bytes
        self.extra_reads += result.extra_reads
        self.duplicate_reads += result.duplicate_reads
        self.unread += result.unread
        self.null_reads += result.null_reads

    def finish(self) -> None:
        self.wrong_lengths = sorted(
            {n for ns in self.wrong_lengths_by_hit.values() for n in ns}
        )


class SweepReport(msgspec.Struct):
    lengths: str
    hits: list[float]
    variants: dict[str, str]
    """Variant name -> where its moriio files came from."""
    layouts: list[LayoutReport]
    wall_seconds: float
    faults: list[FaultReport] = []
    """``--faults``: one row per (pair, layout, fault)."""


WorkerLine = Progress | LayoutReport | FaultReport


def _first(ns: list[int], k: int = 6) -> str:
    head = ", ".join(str(n) for n in ns[:k])
    return head + (", ..." if len(ns) > k else "")


def format_table(report: SweepReport) -> str:
    """One row per layout, variant and mode, within ``TABLE_WIDTH`` columns:
    the lengths tried, the lengths with wrong KV, pages moved (READ or
    WRITE) against the minimum,
    and the first error; a refusal at start spans the row. Texts are clipped
    at a word; every figure and the full texts are in the JSON report."""
    head = ("layout", "variant", "mode", "lengths", "wrong KV", "moved/min", "note")
    rows: list[tuple[str, ...]] = [head]
    for r in report.layouts:
        if r.refused_at_start is not None:
            who = "MoRIIO" if r.refused_by == "connector" else "vLLM"
            rows.append(
                (
                    r.layout,
                    r.variant,
                    r.mode,
                    f"refused by {who}: {r.refused_at_start}",
                )
            )
            continue
        wrong = f"{len(r.wrong_lengths)}"
        if r.wrong_lengths:
            wrong += f" ({_first(r.wrong_lengths, 2)})"
        pages = f"{r.pages_read}/{r.min_pages} = {ratio(r.pages_read, r.min_pages)}"
        note = f"{r.error_cases} errors: {r.first_errors[0]}" if r.error_cases else ""
        rows.append(
            (r.layout, r.variant, r.mode, str(r.lengths_tried), wrong, pages, note)
        )
    widths = [max(len(row[i]) for row in rows if len(row) == 7) for i in range(6)]
    widths[:3] = [max(len(row[i]) for row in rows) for i in range(3)]
    note_room = max(TABLE_WIDTH - sum(widths) - 2 * 6, 20)
    span_room = TABLE_WIDTH - sum(widths[:3]) - 2 * 3
    lines = []
    for i, row in enumerate(rows):
        if len(row) == 4:
            cells = [cell.ljust(w) for cell, w in zip(row[:3], widths, strict=False)]
            lines.append("  ".join([*cells, clip(row[3], span_room)]))
            continue
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, clip(row[6], note_room)]).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in [*widths, min(note_room, 20)]))
    return "\n".join(lines)


def summary_line(report: SweepReport) -> str:
    parts = []
    for variant in report.variants:
        if report.faults:
            fs = [r for r in report.faults if r.variant == variant]
            parts.append(
                f"{variant}: {sum(r.escapes for r in fs)} escapes in "
                f"{count(sum(r.cases for r in fs), 'fault case')}, "
                f"{sum(r.refused_local for r in fs)} served by local prefill"
            )
            continue
        rows = [r for r in report.layouts if r.variant == variant]
        for mode in MODES:
            rs = [r for r in rows if r.mode == mode]
            if rs or (mode == READ and not rows):
                parts.append(_summary_part(row_key(variant, mode), mode, rs))
    cases = sum(r.cases for r in report.layouts) + sum(r.cases for r in report.faults)
    wall = f"; wall {report.wall_seconds:.1f} s"
    return f"{count(cases, 'case')}; " + "; ".join(parts) + wall


def _summary_part(name: str, mode: str, rs: list[LayoutReport]) -> str:
    """One pair's rows of one mode (``name``: the pair, and the mode when
    WRITE) in the summary line."""
    refused = sum(r.refused_at_start is not None for r in rs)
    wrong = sum(bool(r.wrong_lengths) for r in rs)
    over = sum(r.refused_at_start is None and r.pages_read > r.min_pages for r in rs)
    errors = sum(r.error_cases > 0 for r in rs)
    escapes = sum(r.escape_cases > 0 for r in rs)
    sampled = sum(r.sampled_drafter_rows for r in rs)
    drafters = (
        f", {count(sampled, 'drafter row')} read as the prefiller computed "
        f"them from its sampled token (in "
        f"{count(sum(r.sampled_drafter_cases for r in rs), 'case')})"
        if sampled
        else ""
    )
    moving = "reading" if mode == READ else "writing"
    return (
        f"{name}: {count(wrong, 'layout')} with wrong KV, {over} {moving} "
        f"more than the minimum, {errors} with errors ({escapes} with "
        f"escapes), {refused} refused at start{drafters}"
    )


def format_pairs(report: SweepReport) -> str:
    """Layout x pair: the cases, those with wrong KV, crashes (errors that
    did not escape the scheduler), escapes out of the scheduler, and
    fallbacks to local prefill."""
    rows: list[tuple[str, ...]] = [
        ("layout", "pair", "cases", "wrong KV", "crashes", "escapes", "fallbacks")
    ]
    for r in report.layouts:
        if r.refused_at_start is not None:
            rows.append(
                (row_key(r.layout, r.mode), r.variant, "refused at start") + ("",) * 4
            )
            continue
        rows.append(
            (
                row_key(r.layout, r.mode),
                r.variant,
                str(r.cases),
                str(r.wrong_cases),
                str(r.error_cases - r.escape_cases),
                str(r.escape_cases),
                str(r.fallback_cases),
            )
        )
    return table(rows)
