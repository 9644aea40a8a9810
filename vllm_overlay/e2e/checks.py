"""Judge recorded answers: P/D against direct prefill, token for token.

Everything here works on recorded data (``Exchange``), so it is tested on
recorded outputs; the runner records them on hardware.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

from vllm_overlay.e2e.client import Completion

Status = Literal["pass", "fail", "skip"]

BANNER = re.compile(r"vllm-moriio-overlay: series (\S+) \(([^)]*)\) on vLLM (\S+)")


class Transfer(msgspec.Struct, forbid_unknown_fields=True):
    """Decoder counter deltas over one P/D request, in tokens."""

    external_tokens: float
    local_hit_tokens: float
    bytes: int  # external_tokens x kv_bytes_per_token; 0 when unknown


class Exchange(msgspec.Struct, forbid_unknown_fields=True):
    """One prompt sent through P/D (the router) and directly to the prefill."""

    prompt_id: str
    kind: str
    length: int
    expected: str
    pd: Completion
    direct: Completion
    transfer: Transfer | None = None
    skipped: str = ""  # why it was not sent (e.g. longer than max_model_len)


class Case(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    status: Status
    detail: str = ""
    length: int = 0
    first_mismatch: int = -1  # index of the first differing output token


class Section(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    status: Status
    cases: list[Case]
    summary: dict[str, float | int | str] = msgspec.field(default_factory=dict)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def compare(ex: Exchange) -> Case:
    """P/D answer == direct-prefill answer, token for token, on a prompt of
    exactly the intended length on both paths."""
    if ex.skipped:
        return Case(ex.prompt_id, "skip", ex.skipped, ex.length)
    for path, c in (("pd", ex.pd), ("direct", ex.direct)):
        if c.error:
            return Case(ex.prompt_id, "fail", f"{path}: {c.error}", ex.length)
        if c.prompt_tokens != ex.length:
            return Case(
                ex.prompt_id,
                "fail",
                f"{path}: server saw {c.prompt_tokens} prompt tokens, sent {ex.length}",
                ex.length,
            )
        if not c.token_ids:
            return Case(ex.prompt_id, "fail", f"{path}: empty answer", ex.length)
    diff = first_difference(ex.pd.token_ids, ex.direct.token_ids)
    if diff >= 0:
        return Case(
            ex.prompt_id,
            "fail",
            f"P/D {ex.pd.text!r} != direct {ex.direct.text!r}",
            ex.length,
            diff,
        )
    return Case(ex.prompt_id, "pass", "", ex.length)


def section_status(cases: Sequence[Case]) -> Status:
    if any(c.status == "fail" for c in cases):
        return "fail"
    if cases and all(c.status == "skip" for c in cases):
        return "skip"
    return "pass" if cases else "fail"


def sweep_section(exchanges: Sequence[Exchange]) -> Section:
    cases = [compare(ex) for ex in exchanges]
    failed = [c.length for c in cases if c.status == "fail"]
    summary: dict[str, float | int | str] = {
        "prompts": len(cases),
        "mismatches": len(failed),
        "failed_lengths": ", ".join(map(str, failed)),
    }
    return Section("prompt-length sweep", section_status(cases), cases, summary)


def needle_section(exchanges: Sequence[Exchange]) -> Section:
    """Token-for-token against direct prefill, and recall: P/D must find the
    needle whenever the direct prefill does."""
    cases = []
    for ex in exchanges:
        case = compare(ex)
        if case.status != "skip":
            pd_found = ex.expected in ex.pd.text
            direct_found = ex.expected in ex.direct.text
            recall = f"recall P/D={pd_found} direct={direct_found}"
            case.detail = f"{recall}; {case.detail}" if case.detail else recall
            if direct_found and not pd_found:
                case.status = "fail"
        cases.append(case)
    found = sum(1 for ex in exchanges if not ex.skipped and ex.expected in ex.pd.text)
    sent = sum(1 for ex in exchanges if not ex.skipped)
    return Section(
        "needle in a haystack",
        section_status(cases),
        cases,
        {"sent": sent, "pd_recalled": found},
    )


def repeat_section(first: Exchange, second: Exchange) -> Section:
    """The same request twice through P/D: the second answer matches the
    first and the direct prefill, and moves fewer tokens (the decoder's
    prefix cache holds the prompt now)."""
    cases = [compare(first), compare(second)]
    cases[0].id, cases[1].id = "first", "second"
    if cases[1].status == "pass" and first.pd.token_ids != second.pd.token_ids:
        cases[1] = Case("second", "fail", "second answer differs from the first")
    t1, t2 = first.transfer, second.transfer
    if t1 is None or t2 is None:
        shrink = Case("transfer shrinks", "fail", "no decoder transfer counters")
    elif t2.external_tokens < t1.external_tokens:
        shrink = Case(
            "transfer shrinks",
            "pass",
            f"{t1.external_tokens:g} -> {t2.external_tokens:g} tokens",
        )
    else:
        shrink = Case(
            "transfer shrinks",
            "fail",
            f"{t1.external_tokens:g} -> {t2.external_tokens:g} tokens: no shrink",
        )
    cases.append(shrink)
    return Section("full-local-hit repeat", section_status(cases), cases)


def transfer_section(exchanges: Sequence[Exchange]) -> Section:
    """Per-request transfer from the decoder's counters: informational,
    except that a P/D request with no counters at all is a failure."""
    cases = []
    for ex in exchanges:
        if ex.skipped:
            continue
        t = ex.transfer
        if t is None:
            cases.append(Case(ex.prompt_id, "fail", "no counters", ex.length))
            continue
        detail = f"{t.external_tokens:g} tokens loaded, {t.local_hit_tokens:g} local"
        if t.bytes:
            detail += f", {t.bytes} bytes"
        cases.append(Case(ex.prompt_id, "pass", detail, ex.length))
    moved = [ex.transfer for ex in exchanges if ex.transfer is not None]
    summary: dict[str, float | int | str] = {
        "requests": len(moved),
        "tokens_total": sum(t.external_tokens for t in moved),
        "bytes_total": sum(t.bytes for t in moved),
    }
    return Section("transfer per request", section_status(cases), cases, summary)


def overlay_section(logs: Mapping[str, str], expected_series: str = "") -> Section:
    """Which overlay ran: the banner each server logged at start."""
    cases = []
    seen = set()
    for role, text in sorted(logs.items()):
        m = BANNER.search(text)
        if m is None:
            cases.append(Case(role, "fail", "no overlay banner in the log"))
            continue
        series = m.group(1)
        seen.add(series)
        ok = not expected_series or series == expected_series
        detail = m.group(0) if ok else f"{m.group(0)}; expected {expected_series}"
        cases.append(Case(role, "pass" if ok else "fail", detail))
    if len(seen) > 1:
        cases.append(
            Case("agree", "fail", f"legs ran different series: {sorted(seen)}")
        )
    summary: dict[str, float | int | str] = {"series": ", ".join(sorted(seen))}
    return Section("overlay", section_status(cases), cases, summary)
