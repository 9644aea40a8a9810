"""Check what the decoder holds for its last prompt token.

For a prompt of N tokens the decoder computes position N-1 itself and needs:

- full attention: every position < N-1; a cache of one state per ``t``
  tokens (``tokens_per_state``) only the complete groups, positions
  < (N-1) // t * t (the open group's rows live in a ring);
- a window W: positions [N-W, N-1);
- chunked local attention of chunk C: N-1's chunk, [(N-1) // C * C, N-1);
- a ring (``CircularBufferSpec``: one block per request, the row of position
  p in slot p % capacity): the raw rows of the still-open compression group
  of g tokens, [(N-1) // g * g, N-1);
- a Mamba/KDA state: the state after N-1 tokens in the block its step runs
  on. In align mode that is block index (N-1) // block_size; before the step
  the worker copies block (N-2) // block_size into it when they differ
  (``preprocess_mamba``, which runs before ``start_load_kv``: the copy sees
  the pre-READ contents);
- a group that takes no part in transfer (HiSparse hot/resident replicas,
  rebuilt from their source group after a load): nothing.

A page is "lacked" when the decoder's own page does not hold what is needed
before the READ (after that copy), or when what it needs lies past the tokens
the decoder's scheduler counts as computed (its local hit): a freed block the
decoder reallocates can still hold another request's identical KV, but the
decoder does not own it and the load must fill it. The lacked pages are the
minimum READ.

A READ that pairs a null block (the prefiller's as its source, or the
decoder's as its destination) is wrong wherever it lands: the null block is
vLLM's placeholder for a freed or never-allocated page, so the pair copies
nothing of the prompt, or writes into a page every request shares.

A drafter's layers (MTP; EAGLE, in the target's group or in one of its own)
are checked by the same rules as the target's: which page holds which
positions. A drafter row's value is not modelled. The row of position p is
computed from token p + 1, so a prefiller that computes N-1 tokens (hybrid
READ, or READ with a sliding-window group) computes the row of N-2 from its
own sampled token rather than the prompt's token N-1. That row differs from
the decoder's own only where the sample differs from the prompt; it changes
what the drafter proposes, never the output (the target verifies every
draft), as upstream #60867 states for MTP and DSpark.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from vllm_overlay.simulate.pages import PageStore, holds_positions, holds_state

FULL = "full"
WINDOW = "window"
STATE_KIND = "state"
CHUNK = "chunk"
RING = "ring"
LOCAL_ONLY = "local-only"


class GroupInfo(NamedTuple):
    kind: str
    block_tokens: int
    """Positions per block (block size x DCP when sharded)."""
    window: int
    """Window (WINDOW), chunk (CHUNK) or compression group (RING) in tokens."""
    page_bytes: int
    tokens_per_state: int = 1
    """FULL: tokens one stored state covers (compressed caches)."""
    ring_capacity: int = 0
    """RING: positions the ring holds."""
    ring_row_bytes: int = 0
    """RING: bytes of one row in a head's part of the page; 0: one row of the
    layer's ``[H, N, C]`` view."""
    draft_layers: int = 0
    """Drafter layers among the group's (``KVCacheSpec.is_draft``)."""


class Need(NamedTuple):
    group: int
    index: int  # type: ignore[assignment]  # shadows tuple.index
    """Block index in the group's position-indexed table."""
    lo: int
    hi: int
    """Positions [lo, hi) for attention; ``lo`` = token count for a state."""


class CaseResult(msgspec.Struct, frozen=True):
    n: int
    hit_fraction: float
    local_hit_tokens: int
    wrong: bool
    wrong_groups: list[int]
    pages_read: int
    min_pages: int
    bytes_read: int
    min_bytes: int
    extra_reads: int
    """Pages read that the decoder did not lack (already held or not needed)."""
    duplicate_reads: int
    unread: int
    """Lacked pages the READ did not fill with the right contents."""
    error: str | None = None
    null_reads: int = 0
    """Pages READ from the prefiller's null block or into the decoder's."""
    late_reads: int = 0
    """Pages READ on a step whose load vLLM starts after the forward
    (``SchedulerOutput.has_sync_kv_loads`` false: no external tokens): they
    land after the forward that needed them, into blocks the request may
    already have freed."""
    escaped: bool = False
    """The case's exception escaped a leg's ``Scheduler.schedule()`` or
    ``update_from_output()`` (``drive.Escaped``): a server's engine dies."""
    fallback: bool = False
    """The decoder's connector counted no external token although the
    decoder lacked prompt tokens: it served the request by local prefill
    (judged after its forward)."""
    sampled_drafter_rows: int = 0
    """Drafter rows the decoder READ that the prefiller computed from its own
    sampled token instead of the prompt's next token (a prefiller that
    computes fewer than N tokens): one per drafter layer whose page holding
    that row was read. They change what the drafter proposes, never the
    output."""


def sampled_drafter_rows(
    groups: Sequence[GroupInfo],
    tables: Sequence[Sequence[int]],
    reads: Sequence[tuple[int, int]],
    n: int,
    prefilled: int,
) -> int:
    """The drafter rows of ``reads`` computed from the prefiller's sampled
    token: a drafter's row of position p reads token p + 1, so when the
    prefiller computed ``prefilled`` < N tokens its row of ``prefilled - 1``
    (one the decoder attends to, below N - 1) took the token it sampled."""
    row = prefilled - 1
    if not 0 <= row < n - 1:
        return 0
    read = set(reads)
    out = 0
    for g, info in enumerate(groups):
        if not info.draft_layers or info.kind not in (FULL, WINDOW, CHUNK):
            continue
        index = row // info.block_tokens
        if index < len(tables[g]) and (g, tables[g][index]) in read:
            out += info.draft_layers
    return out


def past_hit(need: Need, computed_tokens: int | None) -> bool:
    """Whether ``need`` lies past the decoder's local hit (``None``: unknown):
    the decoder does not own such a page, whatever it holds."""
    if computed_tokens is None:
        return False
    if need.hi == 0:  # a state after ``lo`` tokens
        return need.lo > computed_tokens
    return need.hi > computed_tokens


def needs(groups: Sequence[GroupInfo], n: int) -> list[Need]:
    out: list[Need] = []
    last = n - 1  # the position the decoder computes itself
    for g, info in enumerate(groups):
        bt = info.block_tokens
        if info.kind == LOCAL_ONLY:
            continue
        if info.kind == STATE_KIND:
            if last > 0:
                out.append(Need(g, last // bt, last, 0))
            continue
        if info.kind == RING:
            start = last // info.window * info.window
            if start < last:
                out.append(Need(g, 0, start, last))
            continue
        end = last
        if info.kind == FULL:
            start = 0
            end = last // info.tokens_per_state * info.tokens_per_state
        elif info.kind == CHUNK:
            start = last // info.window * info.window
        else:
            start = max(0, n - info.window)
        if start >= end:
            continue
        for index in range(start // bt, (end - 1) // bt + 1):
            lo = max(start, index * bt)
            hi = min(end, (index + 1) * bt)
            out.append(Need(g, index, lo, hi))
    return out


def _satisfied(store: PageStore, table: Sequence[int], need: Need, uid: int) -> bool:
    if need.index >= len(table):
        return False
    page = store.get(table[need.index])
    if need.hi == 0:
        return holds_state(page, need.group, uid, need.lo)
    return holds_positions(page, need.group, uid, need.lo, need.hi)


def precopy_states(
    groups: Sequence[GroupInfo],
    tables: Sequence[Sequence[int]],
    store: PageStore,
    n: int,
) -> None:
    """Align-mode state precopy of the decoder's first step, pre-READ."""
    last = n - 1
    if last <= 0:
        return
    for g, info in enumerate(groups):
        if info.kind != STATE_KIND:
            continue
        prev, curr = (last - 1) // info.block_tokens, last // info.block_tokens
        table = tables[g]
        if prev != curr and curr < len(table):
            src = store.get(table[prev]) if prev < len(table) else None
            store.put(table[curr], src)


class ReadCheck:
    """Snapshot the decoder's lacked pages, then judge the READ."""

    def __init__(
        self,
        groups: Sequence[GroupInfo],
        tables: Sequence[Sequence[int]],
        store: PageStore,
        n: int,
        uid: int,
        computed_tokens: int | None = None,
        load_before_copy: bool = False,
    ) -> None:
        """``computed_tokens``: the decoder's local hit; ``None`` judges by
        page contents alone. ``load_before_copy``: the load lands before the
        align-mode state copy of the step that computes the request (an
        asynchronous load: ``tables`` are its allocation's, which end at
        N-1 tokens); a state is lacked in the block that copy reads, (N-2) //
        block_size. Judge such a load with ``tables`` set to the computing
        step's, after ``precopy_states``."""
        self.groups = groups
        self.tables = tables
        self.n = n
        self.uid = uid
        self.needs = needs(groups, n)
        self.lacked: set[tuple[int, int]] = set()
        for need in self.needs:
            if load_before_copy and need.hi == 0:
                bt = groups[need.group].block_tokens
                need = need._replace(index=(need.lo - 1) // bt)
            if past_hit(need, computed_tokens) or not _satisfied(
                store, tables[need.group], need, uid
            ):
                table = tables[need.group]
                dst = table[need.index] if need.index < len(table) else -1
                self.lacked.add((need.group, dst))

    def judge(
        self,
        store: PageStore,
        reads: Sequence[tuple[int, int]],
        hit_fraction: float,
        local_hit_tokens: int,
        null_reads: Sequence[int] = (),
    ) -> CaseResult:
        """``reads``: (group, local block id) per page the READ copied;
        ``null_reads``: the group of each pair with a null block on either
        side."""
        wrong_groups = sorted(
            {
                need.group
                for need in self.needs
                if not _satisfied(store, self.tables[need.group], need, self.uid)
            }
            | set(null_reads)
        )
        counts = Counter(reads)
        read_set = set(counts)
        unread = 0
        for group, dst in self.lacked:
            if (group, dst) not in read_set:
                unread += 1
        return CaseResult(
            n=self.n,
            hit_fraction=hit_fraction,
            local_hit_tokens=local_hit_tokens,
            wrong=bool(wrong_groups),
            wrong_groups=wrong_groups,
            pages_read=len(reads),
            min_pages=len(self.lacked),
            bytes_read=sum(self.groups[g].page_bytes for g, _ in reads),
            min_bytes=sum(self.groups[g].page_bytes for g, _ in self.lacked),
            extra_reads=sum(c for key, c in counts.items() if key not in self.lacked),
            duplicate_reads=sum(c - 1 for c in counts.values()),
            unread=unread,
            null_reads=len(null_reads),
        )
