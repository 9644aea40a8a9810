"""Patch 0026: WRITE between unequal TP sizes maps each layer by its own KV heads.

An EAGLE3 drafter beside DeepSeek-V3 (llama_eagle3.py / deepseek_eagle3.py:
Llama-style GQA, 8 KV heads) holds KV heads of its own next to the target's
MLA latents. MoRIIO's WRITE mapping took the model's KV heads (1 for MLA)
for every layer, so at TP 1->2 it copied the drafter's whole 8-head block
into each decode rank, and at TP 2->1 only one prefill rank wrote it.

Each prefill rank is a real ``MoRIIOConnectorWorker`` of a DeepSeek-V3
(MLA) model on stubbed mori; its ``_write_blocks_for_req`` queues one write
per layer, whose mapping is recorded. The heads each decode rank must hold
come from vLLM's sharding rule alone: rank ``i`` of ``tp`` holds heads
``[i * n, (i + 1) * n)``, ``n = heads // tp``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

from tests.patches.builders import (
    full_attention_spec,
    make_kv_cache_config,
    make_vllm_config,
    mla_spec,
    moriio_kv_transfer_config,
    pin_tp_rank,
)

B = 16
MLA, DRAFT = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
DRAFT_HEADS = 8
"""The EAGLE3 drafter's KV heads (8 x 128)."""


Producer = Callable[..., Any]


@pytest.fixture
def producer(
    stub_mori: None, monkeypatch: pytest.MonkeyPatch, deepseek_mtp_model_dir: Path
) -> Producer:
    """Builds prefill rank ``tp_rank`` of ``tp_size`` of a DeepSeek-V3 (MLA)
    model: an MLA group and the drafter's GQA group, with this rank's share
    of the drafter's ``draft_heads`` heads."""

    def build(tp_size: int, tp_rank: int, draft_heads: int = DRAFT_HEADS) -> Any:
        pin_tp_rank(monkeypatch, tp_size, tp_rank)
        vllm_config = make_vllm_config(
            deepseek_mtp_model_dir,
            moriio_kv_transfer_config("kv_producer"),
            block_size=B,
        )
        groups = [
            ([MLA], mla_spec(B)),
            (
                [DRAFT],
                full_attention_spec(
                    B, num_kv_heads=draft_heads // tp_size, head_size=128
                ),
            ),
        ]
        with set_current_vllm_config(vllm_config):
            worker = moriio_connector.MoRIIOConnectorWorker(
                vllm_config, "127.0.0.1:0", make_kv_cache_config(groups)
            )
        assert (worker.tp_rank, worker.world_size) == (tp_rank, tp_size)
        assert worker.use_mla
        return worker

    return build


def _queued_mappings(worker: Any, decode_tp: int) -> dict[str, Any]:
    """The mapping each layer's write is queued with."""
    queued: dict[str, Any] = {}

    def schedule_write_blocks(**kw: Any) -> None:
        queued[kw["layer_name"]] = kw["tp_mapping"]

    worker.schedule_write_blocks = schedule_write_blocks
    meta = types.SimpleNamespace(
        tp_size=decode_tp,
        transfer_id="t-0",
        remote_engine_id="decode",
        local_block_ids=[[1], [2]],
        remote_block_ids=[[3], [4]],
        remote_notify_port=2,
        remote_host="127.0.0.1",
        multi_pod_hosts=None,
        remote_dp_size_local=0,
        remote_dp_size=1,
        write_start_blocks=None,
    )
    for layer in (MLA, DRAFT):
        worker._write_blocks_for_req("req-0", meta, layer, None)
    return queued


def _rank_heads(rank: int, tp: int, heads: int) -> list[int]:
    n = heads // tp
    return list(range(rank * n, (rank + 1) * n))


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)], ids=lambda v: str(v))
def test_each_decode_rank_gets_its_drafter_heads(
    producer: Producer, p_tp: int, d_tp: int
) -> None:
    # decode rank -> position in its block -> global drafter head written there
    landed: dict[int, dict[int, int]] = {d: {} for d in range(d_tp)}
    # decode rank -> write_done count each writer announces, per layer
    announced: dict[int, set[int]] = {d: set() for d in range(d_tp)}
    writers: dict[int, set[int]] = {d: set() for d in range(d_tp)}
    for p in range(p_tp):
        worker = producer(p_tp, p)
        queued = _queued_mappings(worker, d_tp)
        own = _rank_heads(p, p_tp, DRAFT_HEADS)
        draft = queued[DRAFT]
        for target in draft.targets:
            whole = draft.copies_whole_block(target)
            count = len(own) if whole else target.num_heads
            first = 0 if whole else target.local_head
            for i in range(count):
                position = i if whole else target.remote_head + i
                slot = landed[target.tp_rank]
                assert position not in slot, (
                    f"decode rank {target.tp_rank} position {position} written twice"
                )
                slot[position] = own[first + i]
        for layer in (MLA, DRAFT):
            for target in queued[layer].targets:
                announced[target.tp_rank].add(target.num_writers)
                writers[target.tp_rank].add(p)
    for d in range(d_tp):
        want = _rank_heads(d, d_tp, DRAFT_HEADS)
        got = [landed[d].get(i) for i in range(len(want))]
        assert got == want, f"decode rank {d} holds drafter heads {got}, not {want}"
        assert len(landed[d]) == len(want), f"decode rank {d}: stray heads"
        # Every writer announces how many write_done the rank waits for.
        assert announced[d] == {len(writers[d])}, (d, announced[d], writers[d])


def test_unsplittable_drafter_heads_are_refused_in_one_line(
    producer: Producer,
) -> None:
    """Three drafter heads cannot be split over two decode ranks: the
    mapping the handshake builds refuses, naming the layer and both TPs."""
    worker = producer(1, 0, draft_heads=3)
    with pytest.raises(ValueError) as refused:
        worker._write_tp_mapping(2)
    message = str(refused.value)
    assert "\n" not in message
    assert DRAFT in message
    assert "tp_size=1" in message and "tp_size=2" in message


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2)], ids=lambda v: str(v))
def test_mla_layers_are_still_copied_whole(
    producer: Producer, p_tp: int, d_tp: int
) -> None:
    worker = producer(p_tp, 0)
    mla = _queued_mappings(worker, d_tp)[MLA]
    assert [t.tp_rank for t in mla.targets] == list(range(d_tp))
    assert all(mla.copies_whole_block(t) for t in mla.targets)
