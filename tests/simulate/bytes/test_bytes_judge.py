"""The byte judge's destination for a WRITE verdict: the decoder zeroes the
blocks vLLM allocates in the judged step (its first step computes token
N - 1), every layer's page of each (vLLM's ``KVBlockZeroer``: a new block owns
its whole tile). Where the groups differ in bytes per block (DeepSeek-V4 in
the block-outermost layout) other groups' layers overlay that tile: those
bytes are the decoder's own write, not stray bytes of the transfer."""

from __future__ import annotations

import numpy as np

from vllm_overlay.simulate.bytes.judge import ByteJudge
from vllm_overlay.simulate.bytes.kvmem import SharedKV
from vllm_overlay.simulate.bytes.steps import StepPlan, Watch
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
