"""Fault mode: each per-request refusal path of the decoder's connector,
driven through vLLM's real ``Scheduler.schedule()`` with another request in
flight (``simulate --faults``).

vLLM's scheduler calls the connector's ``get_num_new_matched_tokens`` and
``update_state_after_alloc`` with no error handling: an exception there
leaves ``schedule()``, reaches ``EngineCoreProc`` and kills the engine with
every request in flight (issue 35). A fault case prefills two prompts, gives
the decoder one intact payload and one that meets a refusal (below), adds
both and steps the decoder. What a connector that fails a request without
failing the engine must show: the step returns, the intact request reads and
completes with the right KV, and the refused one is served by local prefill
(the decoder computes its prompt itself; its pages are judged by content
after the forward).

The faults (the series patch whose check each one meets in the overlay):

- ``group-count``: the payload's last block-id group dropped (0001's
  hybrid group-count check; a zip over the groups elsewhere);
- ``short-table``: a full-attention group's prefill list cut to half
  (0005/0012: incomplete full-attention tables);
- ``null-window``: the null block as a sliding-window group's last
  prefill page (0008/0014: a freed page in the window);
- ``hook-raises`` (a self-test, only when named): the connector's
  ``get_num_new_matched_tokens`` raises for the request.

A fault whose payload rewrite changes nothing in a layout (no window group,
one group) is counted as not applicable there, not run. A capped external
count is not a fault: vLLM 0.34.0's scheduler gives MoRIIO its whole count
or none (patches/dropped/0007-*.dep3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec

from vllm_overlay.simulate.check import FULL, WINDOW
from vllm_overlay.simulate.tables import clip, table

Lists = list[list[int]]


class FaultContext(NamedTuple):
    """What a payload rewrite needs of the pair: the kind of each payload
    list's group and the prefiller's null block."""

    kinds: list[str]
    null_block: int


def _drop_last_group(lists: Lists, ctx: FaultContext) -> Lists | None:
    return lists[:-1] if len(lists) > 1 else None


def _halve_full_group(lists: Lists, ctx: FaultContext) -> Lists | None:
    for i, kind in enumerate(ctx.kinds):
        if kind == FULL and i < len(lists) and len(lists[i]) > 1:
            out = [list(x) for x in lists]
            out[i] = out[i][: len(out[i]) // 2]
            return out
    return None


def _null_window_page(lists: Lists, ctx: FaultContext) -> Lists | None:
    out = [list(x) for x in lists]
    changed = False
    for i, kind in enumerate(ctx.kinds):
        if kind == WINDOW and i < len(out) and out[i]:
            out[i][-1] = ctx.null_block
            changed = True
    return out if changed else None


class Fault(NamedTuple):
    name: str
    covers: str
    """The series' check (and patch) this fault meets in the overlay."""
    payload: Callable[[Lists, FaultContext], Lists | None] | None = None
    """Rewrite of the payload's ``remote_block_ids`` (None: not applicable)."""
    raises: bool = False
    """``get_num_new_matched_tokens`` raises (a self-test)."""


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault("group-count", "0001 group-count mismatch", payload=_drop_last_group),
        Fault("short-table", "0005/0012 incomplete tables", payload=_halve_full_group),
        Fault("null-window", "0008/0014 null window page", payload=_null_window_page),
        Fault("hook-raises", "self-test: a hook raises", raises=True),
    )
}
DEFAULT_FAULTS = ("group-count", "short-table", "null-window")
"""``--faults`` without a list: every refusal path of the connector."""
DEFAULT_FAULT_LENGTHS = "17,50,100,529,545,600"
"""Several pages at block 16 and 64, past the 512 window, N = 1 mod 16."""
DEFAULT_FAULT_HITS = "0,50"


def parse_faults(text: str) -> list[str]:
    """``--faults``' value: a comma list of ``FAULTS``' names, or ``all``
    (the refusal paths, without the self-test)."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        for name in DEFAULT_FAULTS if part == "all" else (part,):
            if name not in FAULTS:
                raise ValueError(
                    f"unknown fault {name!r}; choose from {', '.join(FAULTS)} or all"
                )
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError("no fault given (e.g. all or null-window)")
    return names


class FaultCase(msgspec.Struct, frozen=True):
    """One fault case: the decoder got an intact request and a faulty one in
    the same step."""

    n: int
    hit_fraction: float
    injected: bool = True
    """False: the fault changes nothing in this layout (not run)."""
    escaped: bool = False
    """An exception left ``schedule()`` / ``update_from_output()``."""
    error: str | None = None
    """The escape, or any other crash of the case."""
    other_right: bool = False
    """The intact request completed and read the right KV."""
    refused_local: bool = False
    """The faulty request completed with the right KV, no page read for it:
    served by local prefill."""
    refused_read: int = 0
    """Pages READ for the faulty request."""
    refused_wrong: bool = False
    """The faulty request completed holding wrong KV."""


class FaultReport(msgspec.Struct, tag="fault"):
    """One (pair, layout, fault): its cases counted."""

    variant: str
    layout: str
    fault: str
    covers: str = ""
    cases: int = 0
    not_applicable: int = 0
    escapes: int = 0
    crashes: int = 0
    """Errors that did not escape the scheduler (the harness or the
    workers)."""
    other_right: int = 0
    refused_local: int = 0
    refused_wrong: int = 0
    first_errors: list[str] = []
    refused_at_start: str | None = None
    seconds: float = 0.0

    def add(self, case: FaultCase) -> None:
        if not case.injected:
            self.not_applicable += 1
            return
        self.cases += 1
        self.escapes += case.escaped
        self.crashes += case.error is not None and not case.escaped
        self.other_right += case.other_right
        self.refused_local += case.refused_local
        self.refused_wrong += case.refused_wrong
        fresh = case.error and case.error not in self.first_errors
        if fresh and case.error is not None and len(self.first_errors) < 3:
            self.first_errors.append(case.error)


def format_faults(reports: Sequence[FaultReport]) -> str:
    """One row per (layout, fault, pair): cases, escapes, the intact
    request right, the refused one served by local prefill."""
    rows = [
        (
            "layout",
            "fault",
            "pair",
            "cases",
            "escapes",
            "other right",
            "local prefill",
            "refused wrong",
            "first error",
        )
    ]
    for r in reports:
        if r.refused_at_start is not None:
            rows.append(
                (
                    r.layout,
                    r.fault,
                    r.variant,
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "refused at start",
                )
            )
            continue
        if not r.cases:
            rows.append((r.layout, r.fault, r.variant, "0", "-", "-", "-", "-", "n/a"))
            continue
        rows.append(
            (
                r.layout,
                r.fault,
                r.variant,
                str(r.cases),
                str(r.escapes),
                f"{r.other_right}/{r.cases}",
                f"{r.refused_local}/{r.cases}",
                str(r.refused_wrong),
                clip(r.first_errors[0], 60) if r.first_errors else "",
            )
        )
    return table(rows)


def apply_payload(fault: Fault, params: dict[str, Any], ctx: FaultContext) -> bool:
    """Rewrite ``params``' ``remote_block_ids`` in place; False when the
    fault changes nothing here."""
    if fault.payload is None:
        return fault.raises
    lists = params.get("remote_block_ids")
    if not isinstance(lists, list) or not all(isinstance(x, list) for x in lists):
        return False
    rewritten = fault.payload([list(x) for x in lists], ctx)
    if rewritten is None:
        return False
    params["remote_block_ids"] = rewritten
    return True
