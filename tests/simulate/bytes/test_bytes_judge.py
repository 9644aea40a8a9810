"""The byte judge's destination for a WRITE verdict: the decoder zeroes the
blocks vLLM allocates in the judged step (its first step computes token
N - 1), every layer's page of each (vLLM's ``KVBlockZeroer``: a new block owns
its whole tile). Where the groups differ in bytes per block (DeepSeek-V4 in
the block-outermost layout) other groups' layers overlay that tile: those
bytes are the decoder's own write, not stray bytes of the transfer."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_overlay.simulate.bytes.judge import ByteJudge
from vllm_overlay.simulate.bytes.kvmem import SharedKV
from vllm_overlay.simulate.bytes.steps import StepPlan, Verdict, Watch
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.simulate.legs import LegOptions, build_leg


def _kv(tmp_path, name: str, kv_layout: str) -> SharedKV:
    from vllm_overlay.simulate.bytes.geometry import Geometry, model_json, rank_specs

    layout = expand([name])[0]
    geometry = Geometry()
    leg = build_leg(
        layout,
        "kv_consumer",
        1,
        300,
        LegOptions(
            kv_cache_layout=kv_layout,
            model_json=model_json(layout, geometry),
            specs=lambda: rank_specs(layout, 1, geometry, 0),
            extra_config={"proxy_ip": ""},
            with_scheduler=False,
            pool_requests=1,
        ),
    )
    return SharedKV(leg.worker_config, kv_layout, str(tmp_path / "kv"), canary=0xC3)


def _judge(kv: SharedKV) -> ByteJudge:
    judge = ByteJudge.__new__(ByteJudge)
    judge.kv = kv
    return judge


def _fill_others(kv: SharedKV, group: int, block: int, byte: int) -> None:
    """Bytes of the layers of every group but ``group`` in ``block``, noted."""
    for v in kv.layers.values():
        if v.group != group:
            v.u8[block] = byte
            kv.touch(v, [block])


def _plan(zero: list[int]) -> StepPlan:
    return StepPlan(None, zero, [], [], False, set(), {}, [])


def test_write_verdict_takes_the_zeroed_tile_of_a_new_block_as_the_decoders(
    tmp_path,
) -> None:
    """DeepSeek-V4-Pro BLNHC: the request's new block of its smallest group
    (compressor states) is zeroed whole at the verdict step; no stray byte,
    yet a transfer byte in a block outside the table still is one."""
    kv = _kv(tmp_path, "deepseek-v4-pro-BLNHC", "BLNHC")
    try:
        judge = _judge(kv)
        groups = sorted({v.group for v in kv.layers.values()})
        assert len(groups) > 1
        small = min(groups, key=lambda g: sum(v.page_bytes for v in kv.layers_of(g)))
        tables = [[0] for _ in groups]
        tables[small] = [4, 5]
        watch = Watch("r", 17, [], dest="table")
        layers = list(kv.layers.values())
        # Other groups' layers held bytes in block 5 (a freed block).
        _fill_others(kv, small, 5, 0x11)
        kv.snapshot(skip=judge._destination(watch, [[0]] * len(groups), None))
        kv.zero_blocks([5])
        assert kv.stray_bytes(judge._destination(watch, tables, None)).size > 0
        kv.snapshot()
        # The same step, judged: the zeroed tile is the decoder's.
        _fill_others(kv, small, 5, 0x22)
        kv.snapshot(skip=judge._destination(watch, tables, _plan([])))
        kv.zero_blocks([5])
        other = next(v for v in layers if v.group != small)
        other.u8[9, ..., 0] ^= 0x5A  # a transfer byte outside the table
        stray = kv.stray_bytes(
            judge._destination(watch, tables, _plan([5]), judging=True)
        )
        assert stray.size > 0
        lo = kv.page_offset(other, 9)
        assert np.all((stray >= lo) & (stray < lo + other.page_bytes))
    finally:
        kv.close()


# -- a request the decoder recomputes instead of judging ----------------------
#
# Its arm leaves its destination pages out of the snapshot for the verdict to
# copy; a request whose WRITE failed gets no verdict. Pages the decoder had
# written before that arm (an earlier recomputed request's zeroed blocks) then
# stay stale in the snapshot, and the next request's verdict took them for
# stray bytes (LFM3 and ZAYA WRITE between TP 1 and 2, where the prefiller
# fails every write).


def _real_judge(tmp_path, name: str = "llama") -> ByteJudge:
    from vllm_overlay.simulate.bytes.geometry import Geometry, model_json, rank_specs
    from vllm_overlay.simulate.bytes.rows import NO_SHARD
    from vllm_overlay.simulate.drive import group_infos

    layout = expand([name])[0]
    geometry = Geometry()
    leg = build_leg(
        layout,
        "kv_consumer",
        1,
        300,
        LegOptions(
            kv_cache_layout="LBNHC",
            model_json=model_json(layout, geometry),
            specs=lambda: rank_specs(layout, 1, geometry, 0),
            extra_config={"proxy_ip": ""},
            with_scheduler=False,
            pool_requests=1,
        ),
    )
    kv = SharedKV(leg.worker_config, "LBNHC", str(tmp_path / "kv"), canary=0xC3)
    groups = group_infos(leg, layout)
    heads = {name: list(range(v.u8.shape[1])) for name, v in kv.layers.items()}
    return ByteJudge(0, 1, kv, groups, [NO_SHARD] * len(groups), heads)


def _arm(judge: ByteJudge, rid: str, blocks: list[int]) -> tuple[Watch, list]:
    watch = Watch(rid, 17, list(range(17)), arm=True, dest="table")
    tables = [blocks]
    judge.arm(watch, tables, None)
    return watch, tables


def _foreign_write(judge: ByteJudge, block: int) -> None:
    """Bytes another process (a prefiller's transfer) writes into ``block``
    of the first layer: not noted by ``touch``."""
    view = next(iter(judge.kv.layers.values()))
    view.u8[block, ..., 0] ^= 0x5A


def _only_stray(judge: ByteJudge, verdict: Verdict, block: int) -> bool:
    """Whether ``verdict``'s stray bytes are exactly ``_foreign_write``'s
    into ``block``."""
    view = next(iter(judge.kv.layers.values()))
    return verdict.stray_bytes == view.u8[block, ..., 0].size and (
        f" block {block} +" in verdict.notes[-1]
    )


def test_a_recomputed_requests_arm_leaves_no_stale_page_for_the_next_verdict(
    tmp_path,
) -> None:
    """The decoder zeroes block 3 (an earlier request's recompute), the next
    request is armed with block 3 in its table, its WRITE fails and it is
    released: the request after that sees no stray byte in block 3."""
    judge = _real_judge(tmp_path)
    try:
        _arm(judge, "a", [1, 2])
        judge.kv.zero_blocks([3])
        _arm(judge, "b", [3, 4])
        released = judge.release()
        assert released is not None and released.stray_bytes == 0, released
        judge.kv.zero_blocks([5, 6])
        watch, tables = _arm(judge, "c", [5, 6])
        verdict = judge.verdict(watch, tables, None)
        assert verdict.stray_bytes == 0, verdict.notes
    finally:
        judge.kv.close()


@pytest.mark.parametrize("block", [3, 4])
def test_a_late_write_into_a_released_requests_page_is_still_stray(
    tmp_path, block
) -> None:
    """After the release, the decoder's recompute writes block 7 (its own);
    a write nobody on the decoder made into a page of the released request
    (3: one the decoder wrote before its arm; 4: one it did not) is a stray
    byte of the next verdict, whose pages are elsewhere."""
    judge = _real_judge(tmp_path)
    try:
        _arm(judge, "a", [1, 2])
        judge.kv.zero_blocks([3])
        _arm(judge, "b", [3, 4])
        assert judge.release() is not None
        judge.kv.zero_blocks([7])
        _foreign_write(judge, block)
        watch, tables = _arm(judge, "c", [5, 6])
        verdict = judge.verdict(watch, tables, None)
        assert _only_stray(judge, verdict, block), verdict.notes
    finally:
        judge.kv.close()


def test_a_release_counts_writes_outside_the_requests_pages_not_the_decoders(
    tmp_path,
) -> None:
    """Between the arm and the release, a write into the request's own page
    (a failed transfer's partial write) and the decoder's own writes (its
    recompute) are not stray; a write into another page is. Nothing armed,
    nothing to release."""
    judge = _real_judge(tmp_path)
    try:
        _arm(judge, "b", [3, 4])
        _foreign_write(judge, 4)
        judge.kv.zero_blocks([8])
        _foreign_write(judge, 9)
        released = judge.release()
        assert released is not None
        assert _only_stray(judge, released, 9), released.notes
        assert judge.release() is None
    finally:
        judge.kv.close()


# -- the faulted request checked next to the judged one -----------------------
#
# A fault case checks the faulted request's pages (``Rank._track_compute``) in
# each step that computes it, between the other request's arm and verdict.
# Both requests are as long, so they have the same needs: the expected rows
# the judge kept for one were taken for the other's, and a READ whose faulted
# request was reported loaded a step before the other's judged the other's
# right pages wrong (test_bytes_faults' ``lie``, now and then).


def _forward(judge: ByteJudge, rid: str, tokens: list[int], blocks: list[int]) -> None:
    """The decoder's forward of ``tokens`` into ``blocks`` (``Rank.compute``)."""
    from types import SimpleNamespace

    from vllm_overlay.simulate.bytes.rank import Rank
    from vllm_overlay.simulate.bytes.steps import Compute

    rank = SimpleNamespace(
        judge=judge, groups=judge.groups, kv=judge.kv, _shards=judge.shards
    )
    Rank.compute(rank, Compute(rid, tokens, 0, len(tokens), [blocks]))


@pytest.mark.parametrize("local_hit", [None, 0])
def test_another_requests_check_between_arm_and_verdict_leaves_both_alone(
    tmp_path, local_hit
) -> None:
    """``c`` and ``x`` hold their own right bytes; ``x`` is checked between
    ``c``'s arm and its verdict: both are right, whether the arm read ``c``'s
    pages (``local_hit`` None) or took them all for lacking (0, a READ at hit
    0: the check is the first to read)."""
    judge = _real_judge(tmp_path)
    try:
        c_tokens, x_tokens = list(range(17)), list(range(100, 117))
        _forward(judge, "c", c_tokens, [1, 2])
        _forward(judge, "x", x_tokens, [3, 4])
        watch = Watch("c", 17, c_tokens, arm=True, dest="table")
        judge.arm(watch, [[1, 2]], local_hit)
        assert judge.wrong_bytes(Watch("x", 17, x_tokens), [[3, 4]]) == 0
        verdict = judge.verdict(watch, [[1, 2]], None)
        assert verdict.wrong_bytes == 0, verdict.notes
        assert verdict.stray_bytes == 0, verdict.notes
    finally:
        judge.kv.close()
