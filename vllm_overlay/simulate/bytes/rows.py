"""Where a layer's rows sit in its pages: the rows a forward over some
positions writes (``forward_rows``), the rows an attention need reads
(``need_rows``), a ring's rows (``slot_rows``) and a DCP rank's share
(``Shard``); ``Gather`` picks a judged group's rows for one gather per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_overlay.simulate.check import FULL, RING, GroupInfo, Need


@dataclass(frozen=True)
class Shard:
    """Decode context parallelism as one rank of a group sees it: of a
    table entry's ``size * B`` positions (a virtual block), runs of
    ``interleave`` positions go to ranks in turn, and this rank keeps its
    runs, in order, in its physical block of ``B`` (vLLM's slot mapping,
    ``v1/worker/block_table.py``). ``size`` 1: the group is not sharded."""

    size: int = 1
    rank: int = 0
    interleave: int = 1

    def own(self, positions: np.ndarray, block_tokens: int) -> tuple[Any, Any, Any]:
        """(table index, slot, position) of each position this rank keeps."""
        index, offset = np.divmod(positions, block_tokens)
        mine = (offset // self.interleave) % self.size == self.rank
        index, offset, positions = index[mine], offset[mine], positions[mine]
        run = self.interleave * self.size
        slots = offset // run * self.interleave + offset % self.interleave
        return index, slots, positions


NO_SHARD = Shard()


def _refuse_compressed(info: GroupInfo) -> None:
    if info.tokens_per_state != 1:
        raise NotImplementedError(
            "byte simulator: a compressed cache under decode context "
            "parallelism is not modelled"
        )


def _sharded_rows(
    info: GroupInfo, shard: Shard, table: list[int], start: int, end: int
) -> list[tuple[int, Any, np.ndarray]]:
    _refuse_compressed(info)
    index, slots, positions = shard.own(np.arange(start, end), info.block_tokens)
    out = []
    for k in np.unique(index):
        if k >= len(table) or table[k] == 0:
            continue
        pick = index == k
        out.append((table[k], slots[pick], positions[pick]))
    return out


def forward_rows(
    info: GroupInfo,
    table: list[int],
    start: int,
    end: int,
    shard: Shard = NO_SHARD,
) -> list[tuple[int, Any, np.ndarray]]:
    """Where a forward over positions ``[start, end)`` writes an attention
    group's rows: (block, slots in it, position whose prefix hash each row
    holds). A ring keeps position p in slot ``p % capacity`` of its one
    block; a compressed cache (one row per ``t`` tokens) writes row r once
    position ``(r + 1) * t - 1`` is computed, hashing that prefix; a block
    holds ``block_tokens / t`` rows. Null blocks take no rows."""
    out: list[tuple[int, Any, np.ndarray]] = []
    if shard.size > 1 and info.kind != RING:
        return _sharded_rows(info, shard, table, start, end)
    if info.kind == RING:
        if table and table[0] != 0 and start < end:
            positions = np.arange(start, end)
            out.append((table[0], positions % info.ring_capacity, positions))
        return out
    t = info.tokens_per_state
    per_block = info.block_tokens // t
    first, stop = start // t, end // t
    for index in range(first // per_block, -(-stop // per_block)):
        if index >= len(table) or table[index] == 0:
            continue
        lo, hi = max(first, index * per_block), min(stop, (index + 1) * per_block)
        if lo < hi:
            rows = np.arange(lo, hi)
            out.append((table[index], rows - index * per_block, (rows + 1) * t - 1))
    return out


def layer_info(info: GroupInfo, view: Any) -> GroupInfo:
    """``info`` with the layer's own rows per state: a group can mix layers
    of different compression (DeepSeek-V4.1's MLA caches of ratio 1 and 2
    and their indexers, or GLM-5.3-Flash's MLA beside its kpool indexer, in
    one block-outermost group)."""
    if info.kind != FULL:
        return info
    t = max(1, int(getattr(view.spec, "tokens_per_state", 1)))
    return info if t == info.tokens_per_state else info._replace(tokens_per_state=t)


def slot_rows(view: Any, block: int, info: GroupInfo) -> np.ndarray:
    """A layer's page as ``[H, rows, row bytes]``: the rows ``forward_rows`` and
    ``need_rows`` index. A ring whose model addresses rows of its own size
    (``ring_row_bytes``) is re-viewed in them; every other page is the
    layer's ``[H, N, C]`` view."""
    page = view.u8[block]
    if info.kind != RING or not info.ring_row_bytes:
        return page
    rows = page.reshape(page.shape[0], -1, info.ring_row_bytes)
    assert np.shares_memory(rows, page), "ring rows must view the page"
    return rows


def need_rows(
    info: GroupInfo, need: Need, shard: Shard = NO_SHARD
) -> tuple[Any, np.ndarray]:
    """The slots and hash positions of an attention need (``check.needs``:
    positions ``[lo, hi)`` of block ``index``); under DCP, of the positions
    this rank keeps."""
    if shard.size > 1 and info.kind != RING:
        _refuse_compressed(info)
        _, slots, positions = shard.own(np.arange(need.lo, need.hi), info.block_tokens)
        return slots, positions
    if info.kind == RING:
        positions = np.arange(need.lo, need.hi)
        return positions % info.ring_capacity, positions
    t = info.tokens_per_state
    rows = np.arange(need.lo // t, need.hi // t)
    return rows - need.index * (info.block_tokens // t), (rows + 1) * t - 1


@dataclass
class Gather:
    """The rows a judged group's needs pick from each of its layers' pages:
    page and slot of every row, the prefix hash it should hold and the need
    it belongs to (``owner``), for one gather per layer."""

    blocks: Any
    slots: Any
    hashes: Any
    owner: Any
    needs: int
    slot_list: list[Any]
    hash_list: list[np.ndarray]

    @classmethod
    def of(
        cls, blocks: list[int], slots: list[Any], hashes: list[np.ndarray]
    ) -> Gather:
        counts = [len(s) for s in slots]
        return cls(
            np.repeat(np.asarray(blocks, dtype=np.intp), counts),
            np.concatenate(slots).astype(np.intp),
            np.concatenate(hashes),
            np.repeat(np.arange(len(blocks)), counts),
            len(blocks),
            slots,
            hashes,
        )

    @classmethod
    def none(cls, slots: list[Any], hashes: list[np.ndarray]) -> Gather:
        """A ring re-viewed in rows of its own: judged page by page."""
        return cls(None, None, None, None, len(slots), slots, hashes)

    def owned(self, per_row: np.ndarray) -> np.ndarray:
        """Per-row counts summed per need."""
        return np.bincount(self.owner, weights=per_row, minlength=self.needs).astype(
            np.int64
        )
