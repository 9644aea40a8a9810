"""Patch 0042: WRITE between unequal TP sizes writes the layers READ reads
whole, and refuses at the handshake the layers READ refuses.

A layer whose ranks hold as many KV heads on both sides is replicated on
every rank (GLM-5's kpool tail ring beside MLA, DeepSeek-V4.1's compressor
ring): READ reads it whole from one prefill rank. WRITE failed every
request with such a ring between unequal TP sizes (its page was taken to
be sized by its rank), and wrote a replicated attention layer as if
its heads were split: with two prefill ranks each wrote its copy into the
other's heads' place, past the decode rank's one head.

Each leg's ranks are real ``MoRIIOConnectorWorker``s over stubbed mori that
register the KV cache tensors vLLM's ``allocate_kv_cache`` lays out (both KV
cache layouts); the prefill rank's handshake reads the decode rank's
metadata from a stand-in socket, and its writer's writes are carried out
byte by byte into the decode ranks' tensors.
"""

from __future__ import annotations

import re
import types
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common,
    moriio_connector,
)
from vllm.v1.kv_cache_interface import CircularBufferSpec, KVCacheSpec

from tests.patches.builders import (
    RegisteredWorker,
    fill_random,
    full_attention_spec,
    make_vllm_config,
    moriio_kv_transfer_config,
    paired_sessions,
    pin_tp_rank,
    register_worker,
)
from tests.patches.test_0032_read_refuses_unservable_layers_at_handshake import (
    PEER,
    _serve_metadata,
)
from tests.patches.test_0035_write_refuses_unservable_layers_at_handshake import (
    _save_every_layer,
)

B = 16
ATTN = "model.layers.1.self_attn.attn"
RING = "model.layers.1.self_attn.tail_ring"


def ring_spec(head_size: int = 64) -> CircularBufferSpec:
    """Two KV heads on every rank of either TP size (a ring beside MLA)."""
    return CircularBufferSpec(
        block_size=B,
        num_kv_heads=2,
        head_size=head_size,
        head_size_v=0,
        dtype=torch.bfloat16,
    )


def specs(kind: str, tp_size: int) -> dict[str, KVCacheSpec]:
    """``replicated``: one KV head on every rank, fewer than the model's two
    (``TINY_LLAMA_CONFIG``), beside a ring of two heads on every rank.
    ``rank-page``: a layer of one head whose size is the rank's share of a
    page (Step5's ring is one attention page of its rank), which no copy
    between the two TP sizes can move."""
    attention = full_attention_spec(B, num_kv_heads=1, head_size=128)
    if kind == "rank-page":
        return {
            ATTN: attention,
            RING: full_attention_spec(B, num_kv_heads=1, head_size=256 // tp_size),
        }
    return {ATTN: attention, RING: ring_spec()}


def _rank(
    monkeypatch: pytest.MonkeyPatch,
    model_dir: Any,
    role: str,
    tp: tuple[int, int],
    kv_layout: str,
    layer_specs: dict[str, KVCacheSpec],
) -> RegisteredWorker:
    """WRITE-mode rank ``tp[1]`` of ``tp[0]``, its caches filled at random."""
    tp_size, tp_rank = tp
    pin_tp_rank(monkeypatch, tp_size, tp_rank)
    vllm_config = make_vllm_config(
        model_dir, moriio_kv_transfer_config(role, read_mode=False), block_size=B
    )
    rank = register_worker(
        vllm_config, layer_specs, kv_layout, f"127.0.0.1:{role}{tp_rank}"
    )
    fill_random(rank.buffer, torch.Generator().manual_seed(hash((role, tp)) % 2**31))
    return rank


def _leg(monkeypatch, model_dir, role, tp_size, kv_layout, kind):
    return [
        _rank(
            monkeypatch, model_dir, role, (tp_size, r), kv_layout, specs(kind, tp_size)
        )
        for r in range(tp_size)
    ]


def _peer_meta(worker: Any) -> Any:
    """What a decode rank's handshake tells the prefill rank of its layers."""
    return types.SimpleNamespace(
        kv_head_layouts={n: x.to_wire() for n, x in worker.kv_head_layouts.items()},
        mamba_state_layouts={},
        attention_block_sizes=dict(worker.attention_block_sizes),
        num_blocks=worker.num_blocks,
    )


def _queue_writes(
    rank: RegisteredWorker, d_tp: int, local: list[list[int]], remote: list[list[int]]
) -> list[dict[str, Any]]:
    """The writes the prefill rank queues for one request, one per layer."""
    worker = rank.worker
    queued: list[dict[str, Any]] = []
    worker.schedule_write_blocks = lambda **kw: queued.append(kw)
    meta = types.SimpleNamespace(
        tp_size=d_tp,
        transfer_id="t",
        remote_engine_id=PEER,
        local_block_ids=local,
        remote_block_ids=remote,
        remote_notify_port=100,
        remote_host="127.0.0.1",
        multi_pod_hosts=None,
        remote_dp_size_local=0,
        remote_dp_size=1,
        write_start_blocks=None,
    )
    for layer, kv_layer in rank.kv_caches.items():
        worker._write_blocks_for_req("r", meta, layer, kv_layer)
    return queued


def _write(
    monkeypatch: pytest.MonkeyPatch,
    rank: RegisteredWorker,
    decode: list[RegisteredWorker],
    p: int,
    queued: list[dict[str, Any]],
    remote: list[list[int]],
) -> None:
    """Carry out prefill rank ``p``'s queued writes into the decode ranks."""
    worker, writer = rank.worker, rank.worker._writer
    p_tp, d_tp = worker.world_size, len(decode)

    def built(engine_id: str) -> tuple[list[Any], Any]:
        match = re.search(r"_tp(\d+)$", engine_id)
        target = decode[int(match.group(1)) if match else p * d_tp // p_tp].worker
        return paired_sessions(worker, target), _peer_meta(target)

    monkeypatch.setattr(worker, "_get_built_session", built)
    allocation = moriio_common.RemoteAllocInfo(block_ids=remote)
    monkeypatch.setattr(writer, "_get_remote_alloc_info", lambda _: allocation)
    for fields in queued:
        fields = dict(fields)
        del fields["kv_layer"]
        fields["remote_block_ids_hint"] = fields.pop("remote_block_ids")
        event = types.SimpleNamespace(synchronize=lambda: None)
        writer._execute_write_task(moriio_common.WriteTask(**fields, event=event))


@pytest.mark.parametrize("kv_layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)], ids=lambda v: str(v))
def test_each_decode_rank_gets_a_whole_copy_of_a_replicated_layer(
    copying_mori, monkeypatch, llama_model_dir, p_tp, d_tp, kv_layout
) -> None:
    """A layer with as many KV heads per rank on both sides (a ring, an
    attention layer of fewer heads than the model's) is written whole into
    every decode rank, from the prefill rank READ reads it from; no other
    byte of the decode ranks' caches changes."""
    prefill = _leg(
        monkeypatch, llama_model_dir, "kv_producer", p_tp, kv_layout, "replicated"
    )
    decode = _leg(
        monkeypatch, llama_model_dir, "kv_consumer", d_tp, kv_layout, "replicated"
    )
    groups = prefill[0].worker.layer_to_group
    local = [[0] for _ in range(len(set(groups.values())))]
    remote = [list(blocks) for blocks in local]
    for layer, (p_block, d_block) in {ATTN: (3, 2), RING: (1, 4)}.items():
        local[groups[layer]], remote[groups[layer]] = [p_block], [d_block]
    before = [rank.buffer.clone() for rank in decode]
    for p, rank in enumerate(prefill):
        _serve_metadata(monkeypatch, rank, decode[p * d_tp // p_tp])
        assert rank.worker._moriio_handshake("127.0.0.1", 7000, d_tp, PEER) == {PEER}
        queued = _queue_writes(rank, d_tp, local, remote)
        assert all(kw["refusal"] is None for kw in queued)
        _write(monkeypatch, rank, decode, p, queued, remote)
    for d, rank in enumerate(decode):
        source = prefill[rank.worker._remote_tp_rank(p_tp)]
        expected = before[d].clone()
        for layer in (ATTN, RING):
            cache = rank.kv_caches[layer]
            dim = cache.shape.index(rank.worker.num_blocks)
            group = groups[layer]
            want = torch.as_strided(
                expected.view(cache.dtype),
                cache.shape,
                cache.stride(),
                cache.storage_offset(),
            )
            want.select(dim, remote[group][0]).copy_(
                source.kv_caches[layer].select(dim, local[group][0])
            )
        assert torch.equal(rank.buffer, expected), f"decode rank {d}"


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)], ids=lambda v: str(v))
def test_a_layer_write_cannot_move_is_refused_at_the_handshake(
    copying_mori, monkeypatch, llama_model_dir, p_tp, d_tp
) -> None:
    """A layer whose per-rank page differs between the TP sizes: the
    prefill rank's handshake with the decoder logs one line naming the layer
    and both TP sizes, once, and each request's writes carry the refusal
    (the writer tells the decoder, which serves the request)."""
    rank = _leg(
        monkeypatch, llama_model_dir, "kv_producer", p_tp, "LBNHC", "rank-page"
    )[0]
    decode = _leg(
        monkeypatch, llama_model_dir, "kv_consumer", d_tp, "LBNHC", "rank-page"
    )
    logged: list[str] = []
    monkeypatch.setattr(
        moriio_connector.logger,
        "error",
        lambda msg, *args, **_: logged.append(str(msg) % args),
    )
    for _ in range(2):
        _serve_metadata(monkeypatch, rank, decode[0])
        rank.worker._moriio_handshake("127.0.0.1", 7000, d_tp, PEER)
    queued = _queue_writes(rank, d_tp, [[1], [1]], [[2], [2]])
    refusals = [line for line in logged if RING in line]
    assert len(refusals) == 1 and "\n" not in refusals[0]
    assert f"prefill TP {p_tp}" in refusals[0] and f"decode TP {d_tp}" in refusals[0]
    assert len(queued) == len(rank.kv_caches)
    assert all(RING in (kw["refusal"] or "") for kw in queued)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2)], ids=lambda v: str(v))
def test_a_ring_whose_page_differs_is_not_written(
    copying_mori, monkeypatch, llama_model_dir, p_tp, d_tp
) -> None:
    """A ring of other rows on the decoder: every write of the request
    carries a refusal naming the ring and both TP sizes."""
    prefill_specs = specs("replicated", p_tp)
    decode_specs = {**prefill_specs, RING: ring_spec(head_size=32)}
    rank = _rank(
        monkeypatch, llama_model_dir, "kv_producer", (p_tp, 0), "LBNHC", prefill_specs
    )
    decoder = _rank(
        monkeypatch, llama_model_dir, "kv_consumer", (d_tp, 0), "LBNHC", decode_specs
    )
    _serve_metadata(monkeypatch, rank, decoder)
    rank.worker._moriio_handshake("127.0.0.1", 7000, d_tp, PEER)
    queued, _ = _save_every_layer(monkeypatch, rank, d_tp)
    assert len(queued) == len(rank.kv_caches)
    for kw in queued:
        refusal = kw["refusal"] or ""
        assert RING in refusal and "\n" not in refusal
        assert f"prefill TP {p_tp}" in refusal and f"decode TP {d_tp}" in refusal
