"""Byte-level report structs (they cross the zygote's stdout and --json) and
the table: layout x mode x TP x KV cache layout, base and overlay side by
side, each cell {cases, wrong-byte cases, bytes moved / minimum}."""

from __future__ import annotations

import re

import msgspec

from vllm_overlay.simulate.lines import Progress
from vllm_overlay.simulate.tables import ratio, table
from vllm_overlay.text import count

# What starts a zygote's report line on its stdout (the driver reads only those).
MARK = "@@bytes "


class ConfigItem(msgspec.Struct, frozen=True):
    """One configuration of a zygote's plan."""

    layout: str
    mode: str
    p_tp: int
    d_tp: int
    kv_layout: str
    kv_heads: int = 4
    fault: str | None = None
    lengths: str | None = None
    """Prompt lengths of this configuration; None: the sweep's."""
    hit_offset: int | None = None
    """None: every prompt length at every decoder prefix hit. Otherwise
    each length at one hit, in turn: the ``i``-th length at hit
    ``(i + hit_offset) % len(hits)`` (``run.plan_items``)."""
    hits: str | None = None
    """Decoder prefix hits (percentages) of this configuration; None: the
    sweep's."""
    write_wait: float | None = None
    """Seconds a promised WRITE is waited for; None: the zygote's."""

    def cases(self, lengths: list[int], hits: list[float]) -> list[tuple[float, int]]:
        """(hit, length) of every case, hit by hit, in the order they run."""
        return [
            (hit, n)
            for h, hit in enumerate(hits)
            for i, n in enumerate(lengths)
            if self.hit_offset is None or (i + self.hit_offset) % len(hits) == h
        ]


def config_name(item: ConfigItem) -> str:
    """How progress lines name a configuration."""
    return f"{item.layout} {item.mode} {item.p_tp}->{item.d_tp} {item.kv_layout}" + (
        f" fault={item.fault}" if item.fault else ""
    )


class ConfigReport(msgspec.Struct, tag="bytes-config"):
    variant: str
    item: ConfigItem
    cases: int = 0
    planned: int = 0
    refused_at_start: str | None = None
    """vLLM or the connector rejected the configuration as the ranks
    started; no case ran."""
    refused: str | None = None
    """Every case failed the same way, three times in a row on fresh
    processes; the remaining cases were not run."""
    error_cases: int = 0
    escape_cases: int = 0
    """Error cases whose exception left rank 0's ``Scheduler.schedule()`` or
    ``update_from_output()`` (a server's engine dies)."""
    first_errors: list[str] = []
    wrong_cases: int = 0
    """Cases with a wrong byte the decoder attends to or a stray write."""
    fallback_cases: int = 0
    """WRITE cases the prefiller failed (``write_failed``) and the decoder
    recomputed (``CaseBytes.fallback``)."""
    stray_cases: int = 0
    wrong_lengths: dict[str, list[int]] = {}
    """Hit percentage -> prompt lengths with wrong bytes."""
    wrong_notes: list[str] = []
    moved_bytes: int = 0
    min_bytes: int = 0
    seconds: float = 0.0
    fault_outcomes: dict[str, int] = {}
    """Transport fault cases (``--faults``) by what became of the faulted
    request (``driver.FAULT_OUTCOMES``)."""
    fault_fired: int = 0
    """Posts the transport fault failed, left pending or cut short."""
    leak_cases: int = 0
    """Fault cases that left the decoder's blocks or a prefiller request
    held."""
    leak_notes: list[str] = []
    held_cases: int = 0
    """Fault cases whose decoder holds the blocks a failed READ still in
    flight may write (``CaseBytes.held_blocks``)."""


class BytesReport(msgspec.Struct):
    lengths: list[int]
    hits: list[float]
    variants: dict[str, str]
    configs: list[ConfigReport]
    wall_seconds: float
    family_lengths: list[int] | None = None
    """The model families' lengths, when not ``lengths``."""
    zygotes: dict[str, int] = {}
    """Zygote processes each variant ran, helpers included
    (``dispatch.py``)."""


ZygoteLine = Progress | ConfigReport


# The exception's class before a refusal's words ("MoRIIOError: ...").
_EXCEPTION_PREFIX = re.compile(r"^(?:[\w.]+(?:Error|Exception|Escape)): ")
# A table cell holds this much of a refusal; the report holds all of it.
REFUSAL_CHARS = 72


def refusal_text(error: str) -> str:
    """A refusal in a table cell: its own words without the exception's
    class, from the start (what it names: the layer, group or peer),
    shortened to ``REFUSAL_CHARS``."""
    text = _EXCEPTION_PREFIX.sub("", error.strip(), count=1)
    if len(text) <= REFUSAL_CHARS:
        return text
    return text[: REFUSAL_CHARS - 3].rstrip() + "..."


def cell(r: ConfigReport | None) -> str:
    if r is None:
        return ""
    if r.refused_at_start is not None:
        return "refused at start: " + refusal_text(r.refused_at_start)
    if r.refused is not None and r.error_cases == r.cases:
        return "refused: " + refusal_text(r.refused)
    text = f"{r.cases} / {r.wrong_cases} / {ratio(r.moved_bytes, r.min_bytes)}"
    if r.fallback_cases:
        text += f" ({r.fallback_cases} recomputed)"
    if r.error_cases:
        text += f" ({r.error_cases} errors"
        text += f", {r.escape_cases} escapes)" if r.escape_cases else ")"
    return text


def row_key(item: ConfigItem) -> tuple[str, str, str, str]:
    heads = "" if item.kv_heads == 4 else f" ({item.kv_heads} KV head)"
    return (item.layout, item.mode, f"{item.p_tp}->{item.d_tp}{heads}", item.kv_layout)


def format_table(report: BytesReport) -> str:
    variants = list(report.variants)
    rows_by_key: dict[tuple[str, str, str, str], dict[str, ConfigReport]] = {}
    for r in report.configs:
        rows_by_key.setdefault(row_key(r.item), {})[r.variant] = r
    header = ("layout", "mode", "TP", "KV layout", *variants)
    rows = [header]
    for key, by_variant in rows_by_key.items():
        rows.append((*key, *(cell(by_variant.get(v)) for v in variants)))
    return (
        table(rows)
        + "\n\ncell: cases / wrong-byte cases / bytes moved / minimum (the bytes "
        "of the pages the decoder lacked); recomputed: WRITE cases the prefiller "
        "failed, served without the transfer"
    )


FAULT_FAILURES = ("wrong", "hung")
"""Outcomes of a faulted request that fail its case."""


def fault_failures(r: ConfigReport) -> int:
    """Fault cases of a configuration that fail: the faulted request
    computed on wrong bytes or never finished, the request next to it moved
    a wrong or stray byte, a case left blocks held, crashed or escaped."""
    faulted = sum(r.fault_outcomes.get(o, 0) for o in FAULT_FAILURES)
    return faulted + r.wrong_cases + r.leak_cases + r.error_cases


def fault_cell(r: ConfigReport | None) -> str:
    """recomputed / wrong / hung / escapes, then what else happened."""
    if r is None:
        return ""
    if r.refused_at_start is not None:
        return "refused at start: " + refusal_text(r.refused_at_start)
    o = r.fault_outcomes
    wrong = o.get("wrong", 0) + r.wrong_cases
    text = f"{o.get('recomputed', 0)} / {wrong} / {o.get('hung', 0)} / {r.escape_cases}"
    extra = [f"{o[k]} {k}" for k in ("loaded", "aborted") if o.get(k)]
    if r.fallback_cases:
        extra.append(f"{r.fallback_cases} other recomputed")
    crashes = r.error_cases - r.escape_cases
    if crashes:
        extra.append(f"{crashes} errors")
    if r.leak_cases:
        extra.append(f"{r.leak_cases} leaks")
    if r.held_cases:
        extra.append(f"{r.held_cases} held")
    if not r.fault_fired and r.cases > r.error_cases:
        extra.append("fault never fired")
    return text + (f" ({', '.join(extra)})" if extra else "")


def format_fault_table(report: BytesReport) -> str:
    """Fault x layout x mode x TP, base and overlay side by side."""
    variants = list(report.variants)
    rows_by_key: dict[tuple[str, ...], dict[str, ConfigReport]] = {}
    for r in report.configs:
        fault = (r.item.fault or "").removeprefix("transport-")
        rows_by_key.setdefault((fault, *row_key(r.item)[:3]), {})[r.variant] = r
    rows: list[tuple[str, ...]] = [("fault", "layout", "mode", "TP", *variants)]
    for fault_key, by_variant in rows_by_key.items():
        rows.append((*fault_key, *(fault_cell(by_variant.get(v)) for v in variants)))
    return (
        table(rows)
        + "\n\ncell: faulted requests recomputed (vLLM's load-failure path) / "
        "wrong (the faulted request computed on a wrong byte, or the request "
        "next to it moved a wrong or stray byte) / hung (not finished within "
        "the bound) / escapes (an exception out of a scheduler hook); loaded: "
        "served from a transfer whose every needed byte landed right; aborted: "
        "finished without a forward; other recomputed: the request next to it "
        "failed too (the prefiller refused it) and was recomputed; errors: a "
        "worker raised (a real engine "
        "dies); leaks: the decoder's free blocks did not come back or the "
        "prefiller never released a request; held: the decoder holds the "
        "blocks of the faulted READ, whose posts never ended, out of its pool"
    )


def findings(report: BytesReport) -> list[str]:
    out = []
    for r in report.configs:
        if r.wrong_cases:
            key = " ".join(row_key(r.item))
            lengths = "; ".join(
                f"hit {hit} %: {ns[:8]}{' ...' if len(ns) > 8 else ''}"
                for hit, ns in r.wrong_lengths.items()
            )
            out.append(f"{r.variant} {key}: {r.wrong_cases} wrong ({lengths})")
            out += [f"    {note}" for note in r.wrong_notes[:2]]
    return out


def summary_line(report: BytesReport) -> str:
    parts = []
    for variant in report.variants:
        rs = [r for r in report.configs if r.variant == variant]
        wrong = sum(bool(r.wrong_cases) for r in rs)
        refused = sum(
            r.refused is not None or r.refused_at_start is not None for r in rs
        )
        over = sum(r.moved_bytes > r.min_bytes for r in rs)
        escapes = sum(r.escape_cases > 0 for r in rs)
        parts.append(
            f"{variant}: {count(wrong, 'configuration')} with wrong bytes, "
            f"{over} moving more than the minimum, {escapes} with escapes, "
            f"{refused} refused"
        )
    cases = sum(r.cases for r in report.configs)
    return (
        f"{count(cases, 'case')} in {count(len(report.configs), 'configuration')}; "
        + "; ".join(parts)
        + f"; wall {report.wall_seconds:.1f} s"
        + (
            "; zygotes " + ", ".join(f"{v} {n}" for v, n in report.zygotes.items())
            if report.zygotes
            else ""
        )
    )


def format_pairs(report: BytesReport) -> str:
    """Configuration x pair: cases, wrong-byte cases, crashes, escapes out
    of the scheduler (fallbacks to local prefill are not reported by the
    connector: none)."""
    rows: list[tuple[str, ...]] = [
        ("configuration", "pair", "cases", "wrong KV", "crashes", "escapes")
    ]
    for r in report.configs:
        name = config_name(r.item)
        if r.refused_at_start is not None:
            rows.append((name, r.variant, "refused at start", "", "", ""))
            continue
        rows.append(
            (
                name,
                r.variant,
                str(r.cases),
                str(r.wrong_cases),
                str(r.error_cases - r.escape_cases),
                str(r.escape_cases),
            )
        )
    return table(rows)
