"""The byte judge of a rank: what every byte of its KV cache should hold,
and whether it does.

The forward writes, for every computed position, bytes that depend on the
position's prefix hash, the layer and the KV head (``content``); a state
page, bytes of the prefix hash at its last position. ``arm`` snapshots the
buffer before a transfer and counts the bytes the decoder lacks (the least
a transfer must move); ``verdict`` checks every byte the decoder holds for
a position the watched request attends to, and every byte changed outside
the transfer's destination pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from vllm_overlay.simulate.bytes.content import (
    POISON,
    attention_bytes,
    layer_key,
    prefix_hashes,
    state_bytes,
)
from vllm_overlay.simulate.bytes.kvmem import SharedKV, same_bytes
from vllm_overlay.simulate.bytes.rows import (
    Gather,
    Shard,
    layer_info,
    need_rows,
    slot_rows,
)
from vllm_overlay.simulate.bytes.steps import StepPlan, Verdict, Watch
from vllm_overlay.simulate.check import RING, STATE_KIND, GroupInfo, needs, past_hit


def state_regions(
    view: Any, tp_rank: int, tp_size: int
) -> list[tuple[int, int, int, int]]:
    """(region, local byte offset, bytes, first global byte) per region
    of a state page: for a KDA page the conv sub-projections, then the
    recurrent state; for a state of another kind (one short-conv array,
    ZAYA's CCA history) each state whole, the same on every rank when the spec says
    it is TP-replicated."""
    from math import prod

    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (  # noqa: E501
        derive_mamba_conv_split,
    )
    from vllm.utils.torch_utils import get_dtype_size

    spec = view.spec
    if not has_conv_split(spec):
        regions = []
        offset = 0
        for k, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True)):
            size = prod(shape) * get_dtype_size(dtype)
            first = 0 if spec.tp_replicated else tp_rank * size
            regions.append((k, offset, size, first))
            offset += size
        return regions
    split = derive_mamba_conv_split(spec, tp_size)
    regions = []
    offset = 0
    for k, size in enumerate(split.proj_bytes):
        regions.append((k, offset, size, tp_rank * size))
        offset += size
    conv_bytes = prod(spec.shapes[0]) * get_dtype_size(spec.dtypes[0])
    assert offset == conv_bytes, (offset, conv_bytes)
    ssm = prod(spec.shapes[1]) * get_dtype_size(spec.dtypes[1])
    regions.append((len(split.proj_bytes), offset, ssm, tp_rank * ssm))
    return regions


def has_conv_split(spec: Any) -> bool:
    """Whether a state is a conv + SSM pair of a model whose conv state vLLM
    splits into sub-projections (``derive_mamba_conv_split``)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return len(spec.shapes) == 2 and spec.mamba_type in (
        MambaAttentionBackendEnum.MAMBA1,
        MambaAttentionBackendEnum.MAMBA2,
        MambaAttentionBackendEnum.GDN_ATTN,
    )


class ByteJudge:
    """What every byte of one rank's KV cache should hold (``content``: a
    position's prefix hash, the layer and the head), as the forward writes
    it (``write_state``, ``heads``, ``layer_keys``) and as ``arm`` and
    ``verdict`` check it for the watched request: every byte the decoder
    holds for a position it attends to, and every byte that changed
    outside the transfer's destination pages."""

    extra_pages: Sequence[tuple[Any, int]] = ()
    """Pages of another request the watched request's transfer runs next
    to, which its own (faulted) transfer may write: not stray."""

    def __init__(
        self,
        tp_rank: int,
        tp_size: int,
        kv: SharedKV,
        groups: list[GroupInfo],
        shards: list[Shard],
        heads: dict[str, list[int]],
    ) -> None:
        self.tp_rank = tp_rank
        self.kv = kv
        self.groups = groups
        self.shards = shards
        self.heads = heads
        """The global KV heads each attention layer holds on this rank."""
        self._regions = {
            name: state_regions(view, tp_rank, tp_size)
            for name, view in kv.layers.items()
            if groups[view.group].kind == STATE_KIND
        }
        self.layer_keys = {name: layer_key(name) for name in kv.layers}
        self._page_bytes: dict[int, int] = {}
        self._hashes: dict[str, np.ndarray] = {}
        self._armed = False
        self._armed_pages: list[tuple[Any, int]] = []
        """The destination pages of the armed request, as its arm saw them."""
        self._min_bytes = 0
        self._expected: dict[Any, np.ndarray] = {}
        """Expected attention rows by (layer, (request, needs)), from the
        watched request's arm to its verdict: the watched request's, and
        those of a request checked meanwhile (``wrong_bytes``: a fault case's
        faulted request), which has the same needs when it is as long."""

    def _state_page_bytes(self, view: Any) -> int:
        return sum(size for _, _, size, _ in self._regions[view.name])

    def _group_page_bytes(self, group: int) -> int:
        """Bytes a transfer of one page of ``group`` moves, over its layers."""
        size = self._page_bytes.get(group)
        if size is None:
            layers = self.kv.layers_of(group)
            if self.groups[group].kind == STATE_KIND:
                size = sum(self._state_page_bytes(v) for v in layers)
            else:
                size = sum(v.page_bytes for v in layers)
            self._page_bytes[group] = size
        return size

    def hash(self, rid: str, tokens: list[int], end: int = 0) -> np.ndarray:
        """Prefix hashes of a request's tokens, at least ``end`` long:
        rows scheduled past the known tokens (speculative padding) hash a
        filler token."""
        need = max(len(tokens), end)
        cached = self._hashes.get(rid)
        if cached is None or len(cached) < need:
            padded = list(tokens) + [-1] * (need - len(tokens))
            cached = prefix_hashes(padded)
            self._hashes[rid] = cached
            while len(self._hashes) > 16:
                del self._hashes[next(iter(self._hashes))]
        return cached

    def write_state(self, view: Any, block: int, h: int | None) -> None:
        self.kv.touch(view, (block,))
        page = view.u8[block].reshape(-1)
        for region, offset, size, first in self._regions[view.name]:
            if h is None:
                page[offset : offset + size] = POISON
            else:
                page[offset : offset + size] = state_bytes(
                    h, self.layer_keys[view.name], region, first, size
                )

    def state_wrong(self, view: Any, block: int, h: int) -> int:
        page = view.u8[block].reshape(-1)
        wrong = 0
        for region, offset, size, first in self._regions[view.name]:
            expected = state_bytes(h, self.layer_keys[view.name], region, first, size)
            actual = page[offset : offset + size]
            if not same_bytes(actual, expected):
                wrong += int(np.count_nonzero(actual != expected))
        return wrong

    def _attention_wrong(
        self,
        view: Any,
        info: GroupInfo,
        blocks: list[int],
        slots: list[Any],
        hashes: list[np.ndarray],
        expected: dict[Any, np.ndarray],
        key: Any,
    ) -> np.ndarray:
        """Wrong bytes of each page ``blocks[i]``'s rows ``slots[i]`` (which
        should hold the positions of prefix hashes ``hashes[i]``), in one
        gather and one comparison for the layer. The bytes they should hold
        are kept in ``expected`` under ``key``: they depend on the request's
        positions (their prefix hashes) only, not on the blocks holding
        them."""
        if info.kind == RING and info.ring_row_bytes:
            return np.array(
                [
                    self._rows_wrong(view, slot_rows(view, b, info)[:, s, :], h)
                    for b, s, h in zip(blocks, slots, hashes, strict=True)
                ],
                dtype=np.int64,
            )
        gather = Gather.of(blocks, slots, hashes)
        return gather.owned(self._wrong_rows(view, gather, expected, key))

    def _wrong_rows(
        self, view: Any, gather: Gather, expected: dict[Any, np.ndarray], key: Any
    ) -> np.ndarray:
        """Wrong bytes of each row ``gather`` picks from ``view``."""
        actual = view.u8[gather.blocks, :, gather.slots, :]
        want = expected.get(key)
        if want is None:
            want = attention_bytes(
                gather.hashes,
                self.layer_keys[view.name],
                self.heads[view.name],
                actual.shape[-1],
                rows_first=True,
            )
            expected[key] = want
        if actual.shape == want.shape and same_bytes(actual, want):
            return np.zeros(len(actual), dtype=np.int64)
        return np.count_nonzero(actual != want, axis=(1, 2))

    def _rows_wrong(self, view: Any, actual: np.ndarray, hashes: np.ndarray) -> int:
        expected = attention_bytes(
            hashes,
            self.layer_keys[view.name],
            self.heads[view.name],
            actual.shape[-1],
        )
        return int(np.count_nonzero(actual != expected))

    # -- the judge -----------------------------------------------------------

    def _needs(
        self,
        watch: Watch,
        tables: list[list[int]],
        lacking: Callable[[Any], bool] | None = None,
    ) -> list[tuple[Any, int, int]]:
        """(need, wrong bytes, bytes a transfer of its page moves) per need.
        A group's attention needs are judged together, one layer at a time
        (``_attention_wrong``). A need for which ``lacking`` is true (the
        decoder lacks its page whatever the page holds) is not read: its
        wrong bytes are given as its page's bytes."""
        hashes = self.hash(watch.rid, watch.tokens)
        all_needs = needs(self.groups, watch.n)
        out: list[tuple[Any, int, int]] = []
        pending: dict[int, list[int]] = {}
        """Group -> indices in ``out`` of its attention needs to judge."""
        for need in all_needs:
            info = self.groups[need.group]
            table = tables[need.group]
            layers = self.kv.layers_of(need.group)
            size = self._group_page_bytes(need.group)
            if (
                need.index >= len(table)
                or table[need.index] == 0
                or (lacking is not None and lacking(need))
            ):
                out.append((need, size, size))
                continue
            block = table[need.index]
            if info.kind == STATE_KIND:
                wrong = sum(
                    self.state_wrong(v, block, int(hashes[need.lo - 1])) for v in layers
                )
                out.append((need, wrong, size))
                continue
            pending.setdefault(need.group, []).append(len(out))
            out.append((need, 0, size))
        for g, indices in pending.items():
            info = self.groups[g]
            group_needs = [out[i][0] for i in indices]
            # The rows depend on the request's tokens, not on its needs only.
            needs_key = (watch.rid, tuple(group_needs))
            blocks = [tables[g][need.index] for need in group_needs]
            wrong = np.zeros(len(indices), dtype=np.int64)
            # Layers whose rows per state agree share their rows: one gather
            # plan per distinct layer geometry, the wrong bytes of its rows
            # summed over its layers before they are counted per need.
            plans: dict[GroupInfo, tuple[Gather, list[Any]]] = {}
            for v in self.kv.layers_of(g):
                own = layer_info(info, v)
                plan = plans.get(own)
                if plan is None:
                    rows = [
                        need_rows(own, need, self.shards[g]) for need in group_needs
                    ]
                    need_slots = [slots for slots, _ in rows]
                    need_hashes = [hashes[at] for _, at in rows]
                    if info.kind == RING and info.ring_row_bytes:
                        plan = (Gather.none(need_slots, need_hashes), [])
                    else:
                        plan = (Gather.of(blocks, need_slots, need_hashes), [])
                    plans[own] = plan
                gather, sums = plan
                if gather.blocks is None:
                    wrong += self._attention_wrong(
                        v,
                        info,
                        blocks,
                        gather.slot_list,
                        gather.hash_list,
                        self._expected,
                        (v.name, needs_key),
                    )
                    continue
                per_row = self._wrong_rows(
                    v, gather, self._expected, (v.name, needs_key)
                )
                if sums:
                    sums[0] += per_row
                else:
                    sums.append(per_row.astype(np.int64))
            for gather, sums in plans.values():
                if sums:
                    wrong += gather.owned(sums[0])
            for i, w in zip(indices, wrong.tolist(), strict=True):
                need, _, size = out[i]
                out[i] = (need, w, size)
        return out

    def wrong_bytes(self, watch: Watch, tables: list[list[int]]) -> int:
        """Wrong bytes of every page the request attends to, now."""
        return sum(wrong for _, wrong, _ in self._needs(watch, tables))

    def arm(
        self,
        watch: Watch,
        tables: list[list[int]],
        local_hit: int | None,
        plan: StepPlan | None = None,
    ) -> None:
        """Snapshot the buffer but for the transfer's destination pages (the
        judge compares around them and copies them after); the bytes of the
        pages the decoder lacks now are the minimum a transfer must move. A
        page lacks what it holds wrong, or anything past the decoder's local
        hit when that is known (the scheduler simulator's rule,
        ``check.past_hit``): a reallocated block can still hold identical
        bytes the decoder does not own."""
        self._armed_pages = self._destination(watch, tables, plan)
        self.kv.snapshot(skip=self._armed_pages)
        self._armed = True
        self._expected = {}

        def lacking(need: Any) -> bool:
            return past_hit(need, local_hit)

        # A page past the local hit counts whatever it holds: not read.
        needs = self._needs(watch, tables, lacking)
        self._min_bytes = sum(size for _, wrong, size in needs if wrong)

    def verdict(
        self, watch: Watch, tables: list[list[int]], plan: StepPlan | None
    ) -> Verdict:
        assert self._armed, "verdict before arm"
        verdict = Verdict(min_bytes=self._min_bytes)
        for need, wrong, _ in self._needs(watch, tables):
            if wrong:
                verdict.wrong_needs += 1
                verdict.wrong_bytes += wrong
                if len(verdict.notes) < 3:
                    what = "state" if need.hi == 0 else f"{need.lo}..{need.hi}"
                    verdict.notes.append(
                        f"rank {self.tp_rank}: group {need.group} page "
                        f"{need.index} ({what}): {wrong} wrong bytes"
                    )
        if plan is not None and not plan.has_sync_kv_loads and watch.dest == "meta":
            meta = plan.metadata.reqs_to_recv.get(watch.rid)
            if meta is not None and any(meta.local_block_ids):
                verdict.late_reads += 1
                verdict.notes.append(
                    f"rank {self.tp_rank}: READ posted on a step without a "
                    "synchronous load (no external tokens): it lands after the "
                    "forward"
                )
        self._stray(verdict, self._destination(watch, tables, plan, judging=True))
        self._armed = False
        self._expected = {}
        return verdict

    def release(self) -> Verdict | None:
        """End an armed request the decoder recomputes instead of judging
        (its WRITE failed), before the snapshot serves the next request:
        the bytes changed since its arm outside its destination pages (a
        failed transfer writes its own pages at most) and outside the pages
        this rank wrote since (its recompute: the decoder's own bytes), as
        a verdict of stray bytes only; None when nothing is armed.

        ``arm`` leaves the destination pages out of the snapshot, for the
        verdict to copy; without this they stay as they were before the
        arm, and the next verdict takes the decoder's own earlier writes
        into them (a recomputed request's zeroed blocks) for stray bytes."""
        if not self._armed:
            return None
        verdict = Verdict()
        self._stray(
            verdict,
            [*self._armed_pages, *self.extra_pages, *self.kv.touched_pages()],
        )
        self._armed = False
        self._expected = {}
        return verdict

    def _stray(self, verdict: Verdict, pages: list[tuple[Any, int]]) -> None:
        """Count in ``verdict`` the bytes changed since the arm outside
        ``pages``; the snapshot equals the buffer again afterwards."""
        stray = self.kv.stray_bytes(pages)
        verdict.stray_bytes = int(stray.size)
        if stray.size:
            verdict.notes.append(
                f"rank {self.tp_rank}: {stray.size} bytes written outside the "
                f"destination pages, first at {self._describe(int(stray[0]))}"
            )

    def _destination(
        self,
        watch: Watch,
        tables: list[list[int]],
        plan: StepPlan | None,
        judging: bool = False,
    ) -> list[tuple[Any, int]]:
        """The pages the watched request's transfer may write: a READ's
        ``ReqMeta`` local lists (READ arms and judges in one step), the
        request's table for WRITE (a table only grows from arm to judge).

        WRITE judges (``judging``) on the decoder's first step, after vLLM
        zeroed the blocks allocated in it: every layer's page of such a block
        of the request's table (vLLM's ``KVBlockZeroer``: a new block owns its whole
        tile, which other groups' layers overlay when the groups differ in
        bytes per block) is the decoder's own write, not the transfer's."""
        pages = list(self.extra_pages)
        if watch.dest == "meta":
            assert plan is not None
            meta = plan.metadata.reqs_to_recv.get(watch.rid)
            if meta is not None:
                for g, blocks in zip(
                    plan.payload_groups, meta.local_block_ids, strict=False
                ):
                    pages += [(v, b) for b in blocks for v in self.kv.layers_of(g)]
        else:
            for g, blocks in enumerate(tables):
                pages += [
                    (v, b) for b in blocks if b != 0 for v in self.kv.layers_of(g)
                ]
            if judging and plan is not None:
                owned = {b for blocks in tables for b in blocks if b != 0}
                pages += [
                    (v, b)
                    for b in plan.zero
                    if b in owned
                    for v in self.kv.layers.values()
                ]
        return pages

    def _describe(self, offset: int) -> str:
        for view in self.kv.layers.values():
            start = self.kv.page_offset(view, 0)
            stride = view.u8.strides[0]
            block, within = divmod(offset - start, stride)
            if 0 <= block < view.u8.shape[0] and within < view.page_bytes:
                return f"byte {offset} ({view.name} block {block} +{within})"
        return f"byte {offset}"
