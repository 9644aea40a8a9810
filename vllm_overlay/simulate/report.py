"""Report structs (cross the worker process boundary and --json) and table."""

from __future__ import annotations

from typing import Protocol

import msgspec

from vllm_overlay.simulate.check import CaseResult
from vllm_overlay.simulate.procs import ratio, table


class CaseCounts(Protocol):
    cases: int
    error_cases: int
    first_errors: list[str]


def count_case(report: CaseCounts, error: str | None) -> bool:
    """Count one case; True when it is an error (the first three distinct
    errors are kept)."""
    report.cases += 1
    if error is None:
        return False
    report.error_cases += 1
    if len(report.first_errors) < 3 and error not in report.first_errors:
        report.first_errors.append(error)
    return True


class PlanItem(msgspec.Struct):
    """One layout's share of a worker's job."""

    layout: str
    lengths: str
    hits: str


class Progress(msgspec.Struct, tag="progress"):
    variant: str
    layout: str
    done: int
    total: int


class LayoutReport(msgspec.Struct, tag="layout"):
    variant: str
    layout: str
    note: str
    family: str = ""
    """Model family (empty for the mechanism layouts)."""
    source: str = ""
    """The vLLM code whose spec construction the layout follows."""
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
    seconds: float = 0.0

    def add(self, result: CaseResult) -> None:
        if count_case(self, result.error):
            return
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


WorkerLine = Progress | LayoutReport


def _first(ns: list[int], k: int = 6) -> str:
    head = ", ".join(str(n) for n in ns[:k])
    return head + (", ..." if len(ns) > k else "")


def format_table(report: SweepReport) -> str:
    hits = report.hits
    rows = [
        (
            "layout",
            "variant",
            "lengths",
            "wrong-KV lengths",
            "wrong per hit %",
            "pages read/min",
            "bytes",
            "extra/dup/unread",
            "errors",
        )
    ]
    for r in report.layouts:
        if r.refused_at_start is not None:
            rows.append(
                (
                    r.layout,
                    r.variant,
                    "-",
                    "refused at start: " + r.refused_at_start[:70],
                    "",
                    "",
                    "",
                    "",
                    "",
                )
            )
            continue
        wrong = f"{len(r.wrong_lengths)}"
        if r.wrong_lengths:
            wrong += f" ({_first(r.wrong_lengths, 5)})"
        rows.append(
            (
                r.layout,
                r.variant,
                str(r.lengths_tried),
                wrong,
                " ".join(
                    f"{hit}:{len(r.wrong_lengths_by_hit.get(hit, []))}"
                    for hit in (f"{h:g}" for h in hits)
                ),
                f"{r.pages_read}/{r.min_pages} = {ratio(r.pages_read, r.min_pages)}",
                ratio(r.bytes_read, r.min_bytes),
                f"{r.extra_reads}/{r.duplicate_reads}/{r.unread}",
                str(r.error_cases)
                + (f" ({r.first_errors[0][:60]})" if r.first_errors else ""),
            )
        )
    return table(rows)


def summary_line(report: SweepReport) -> str:
    parts = []
    for variant in report.variants:
        rs = [r for r in report.layouts if r.variant == variant]
        refused = sum(r.refused_at_start is not None for r in rs)
        wrong = sum(bool(r.wrong_lengths) for r in rs)
        over = sum(
            r.refused_at_start is None and r.pages_read > r.min_pages for r in rs
        )
        errors = sum(r.error_cases > 0 for r in rs)
        parts.append(
            f"{variant}: {wrong} layout(s) with wrong KV, {over} reading more than "
            f"the minimum, {errors} with errors, {refused} refused at start"
        )
    cases = sum(r.cases for r in report.layouts)
    return f"{cases} cases; " + "; ".join(parts) + f"; wall {report.wall_seconds:.1f} s"
