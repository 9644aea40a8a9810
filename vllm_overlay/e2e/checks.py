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
from vllm_overlay.e2e.launch import ContainerState
from vllm_overlay.text import count

Status = Literal["pass", "fail", "skip"]

BANNER = re.compile(r"vllm-moriio-overlay: series (\S+) \(([^)]*)\) on vLLM (\S+)")
BASE_BANNER = re.compile(r"vllm-moriio-overlay: no overlay manifest")


class Transfer(msgspec.Struct, forbid_unknown_fields=True):
    """Decoder counter deltas over one P/D request, in tokens."""

    external_tokens: float
    local_hit_tokens: float
    bytes: int  # external_tokens x kv_bytes_per_token; 0 when unknown
    # What the decode nodes' RDMA NICs received over the request
    # (`port_rcv_data` deltas x 4, nic.py); -1: not read.
    nic_bytes: int = -1


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
    # What the rules predict for this image (see expect.py), e.g.
    # "expected: lookahead-shift (fixed by ...)"; "" when nothing fails.
    expected: str = ""


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


def sweep_section(
    exchanges: Sequence[Exchange],
    predicted: Mapping[int, Sequence[str]] | None = None,
) -> Section:
    """P/D == direct per length. ``predicted`` maps a length to the rules
    that make it fail on the image that ran (expect.py); the summary splits
    the failures into predicted and unexpected ones, and names the predicted
    failures that did not happen."""
    predicted = predicted or {}
    cases = [compare(ex) for ex in exchanges]
    for case in cases:
        rules = predicted.get(case.length, ())
        if rules:
            case.expected = "expected to fail: " + ", ".join(rules)
    failed = [c.length for c in cases if c.status == "fail"]
    unexpected = [c.length for c in cases if c.status == "fail" and not c.expected]
    missed = [c.length for c in cases if c.status == "pass" and c.expected]
    summary: dict[str, float | int | str] = {
        "prompts": len(cases),
        "mismatches": len(failed),
        "failed_lengths": ", ".join(map(str, failed)),
        "unexpected_failures": ", ".join(map(str, unexpected)),
        "predicted_but_passed": ", ".join(map(str, missed)),
    }
    return Section("prompt-length sweep", section_status(cases), cases, summary)


def prefix_section(
    pairs: Sequence[tuple[Exchange, Exchange]], notes: Sequence[str] = ()
) -> Section:
    """Prefix-hit transfers: each pair's second prompt shares a prefix with
    its first. Both answers match the direct prefill, and the second moves
    fewer tokens. ``notes`` (one per pair) say what each READ should move."""
    cases: list[Case] = []
    for i, (first, second) in enumerate(pairs):
        cases += [compare(first), compare(second)]
        t1, t2 = first.transfer, second.transfer
        note = notes[i] if i < len(notes) else ""
        label = f"{second.prompt_id} transfer"
        if t1 is None or t2 is None:
            cases.append(Case(label, "fail", "no decoder transfer counters"))
        else:
            moved = f"{t1.external_tokens:g} -> {t2.external_tokens:g} tokens"
            if t2.bytes:
                moved += f" ({t2.bytes} bytes)"
            if t1.nic_bytes >= 0 and t2.nic_bytes >= 0:
                moved += f", NIC received {t1.nic_bytes} -> {t2.nic_bytes} bytes"
            ok = t2.external_tokens < t1.external_tokens
            detail = moved if ok else f"{moved}: the shared prefix was not a hit"
            cases.append(
                Case(label, "pass" if ok else "fail", f"{detail}; {note}".strip("; "))
            )
    return Section("prefix-hit transfers", section_status(cases), cases)


def accuracy_section(
    pd_score: float,
    direct_score: float,
    problems: int,
    threshold: float,
    max_drop: float,
    errors: int = 0,
) -> Section:
    """The GSM8K-style second opinion: P/D at least ``threshold`` and not
    more than ``max_drop`` below the direct prefill."""
    cases = [
        Case(
            "P/D score",
            "pass" if pd_score >= threshold else "fail",
            f"{pd_score:.3f} (threshold {threshold:g})",
        ),
        Case(
            "P/D vs direct",
            "pass" if pd_score >= direct_score - max_drop else "fail",
            f"P/D {pd_score:.3f}, direct {direct_score:.3f} (max drop {max_drop:g})",
        ),
    ]
    if errors:
        cases.append(Case("requests", "fail", f"{count(errors, 'request')} failed"))
    summary: dict[str, float | int | str] = {
        "problems": problems,
        "pd": round(pd_score, 4),
        "direct": round(direct_score, 4),
    }
    return Section("accuracy (GSM8K-style)", section_status(cases), cases, summary)


def front_end_section(kind: str, configured: str, measured: str, shift: int) -> Section:
    """Which front end ran and what it sends the decoder for max_tokens."""
    ok = configured in ("auto", measured)
    detail = f"{kind}: decoder gets max_tokens {'- 1' if shift else 'unchanged'}"
    if not ok:
        detail = f"configured {configured}, measured {measured}; {detail}"
    case = Case("max_tokens", "pass" if ok else "fail", detail)
    summary: dict[str, float | int | str] = {
        "kind": kind,
        "max_tokens": measured,
        "pd_request_extra_tokens": shift,
    }
    return Section("front end", section_status([case]), [case], summary)


def launch_section(stopped: Sequence[ContainerState], error: str) -> Section:
    """Containers that stopped while the run needed them, with their last
    log lines; a run that stopped early for another reason."""
    cases = [
        Case(s.what, "fail", f"{s.describe()}:\n" + "\n".join(s.last_lines))
        for s in stopped
    ]
    if error and not cases:
        cases.append(Case("run", "fail", error))
    if not cases:
        cases.append(Case("run", "pass", "every container stayed up"))
    return Section("launch", section_status(cases), cases)


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


def repeat_section(first: Exchange, *repeats: Exchange) -> Section:
    """The same request again through P/D: every answer matches the first
    and the direct prefill, and the last one moves fewer tokens (the
    decoder's prefix cache holds the prompt). With M decode servers the
    prompt is repeated M times, so that under round robin the last repeat
    lands on a decoder that served it before."""
    second = repeats[-1]
    cases = [compare(first)]
    cases[0].id = "first"
    for i, again in enumerate(repeats):
        case = compare(again)
        case.id = "second" if len(repeats) == 1 else f"repeat {i + 1}"
        if case.status == "pass" and first.pd.token_ids != again.pd.token_ids:
            case = Case(case.id, "fail", "answer differs from the first")
        cases.append(case)
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
        if t.nic_bytes >= 0:
            detail += f", NIC received {t.nic_bytes} bytes"
        cases.append(Case(ex.prompt_id, "pass", detail, ex.length))
    moved = [ex.transfer for ex in exchanges if ex.transfer is not None]
    summary: dict[str, float | int | str] = {
        "requests": len(moved),
        "tokens_total": sum(t.external_tokens for t in moved),
        "bytes_total": sum(t.bytes for t in moved),
        # -1: the decode nodes' NIC counters were not read.
        "nic_bytes_total": (
            sum(t.nic_bytes for t in moved)
            if moved and all(t.nic_bytes >= 0 for t in moved)
            else -1
        ),
    }
    return Section("transfer per request", section_status(cases), cases, summary)


# The series id an A/B base image (`image build --series none`) must show:
# the banner's base line on every server.
NO_SERIES = "none"


def overlay_section(logs: Mapping[str, str], expected_series: str = "") -> Section:
    """Which overlay ran: the banner each server logged at start
    (``expected_series`` NO_SERIES: the base line of an A/B base image)."""
    if not logs:
        why = "no server logs collected (servers started outside the harness)"
        return Section("overlay", "skip", [Case("logs", "skip", why)])
    cases = []
    seen = set()
    for role, text in sorted(logs.items()):
        m = BANNER.search(text)
        if expected_series == NO_SERIES:
            base = BASE_BANNER.search(text)
            if base is not None and m is None:
                seen.add(NO_SERIES)
                cases.append(Case(role, "pass", "the base's MoRIIO files (no series)"))
            else:
                found = m.group(0) if m else "no overlay banner in the log"
                cases.append(Case(role, "fail", f"{found}; expected the base"))
            continue
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


def image_series(logs: Mapping[str, str]) -> list[str] | None:
    """The patches the servers ran, from their banners: [] for the base,
    None when no server logged a banner."""
    for _, text in sorted(logs.items()):
        m = BANNER.search(text)
        if m is not None:
            return [p.strip() for p in m.group(2).split(",") if p.strip()]
        if BASE_BANNER.search(text):
            return []
    return None
