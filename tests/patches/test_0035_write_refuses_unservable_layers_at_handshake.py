"""Patch 0035: a WRITE prefiller refuses a decoder of another TP size it
cannot write a layer to, without raising from the forward pass.

WRITE slices each layer by rank between unequal TP sizes. A recurrent state
without a conv split (LFM3's ShortConv, ZAYA's CCA state) has no per-rank
slice layout: the prefiller raised it from ``save_kv_layer``, in the forward
pass of a running engine, at its first request to such a decoder.

The prefill rank is a real WRITE-mode ``MoRIIOConnectorWorker`` over stubbed
mori; its writer fails the request once the decoder's allocation arrives.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec

from tests.patches.builders import (
    RegisteredWorker,
    full_attention_spec,
    kda_mamba_spec,
    make_vllm_config,
    moriio_kv_transfer_config,
    pin_tp_rank,
    register_worker,
)

B = 16
DECODE_PEER = "127.0.0.1:7000"
ATTN = "model.layers.1.self_attn.attn"
CONV = "model.layers.0.short_conv"
PAGE = full_attention_spec(B, num_kv_heads=1, head_size=128).page_size_bytes


def short_conv_spec(tp_size: int) -> MambaSpec:
    """LFM3's ShortConv state: one conv array, its channels split over TP."""
    return kda_mamba_spec(
        block_size=B,
        shapes=((256 // tp_size, 3),),
        dtypes=(torch.bfloat16,),
        page_size_padded=PAGE,
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
    )


def specs(kind: str, tp_size: int) -> dict[str, KVCacheSpec]:
    attention = full_attention_spec(B, num_kv_heads=1, head_size=128)
    if kind == "short-conv":
        return {ATTN: attention, CONV: short_conv_spec(tp_size)}
    return {ATTN: attention}


def _prefill_rank(monkeypatch, model_dir, tp_size: int, kind: str) -> RegisteredWorker:
    pin_tp_rank(monkeypatch, tp_size, 0)
    vllm_config = make_vllm_config(
        model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        block_size=B,
    )
    return register_worker(vllm_config, specs(kind, tp_size), "LBNHC", "p")


def _metadata(d_tp: int) -> moriio_common.MoRIIOConnectorMetadata:
    host, port = DECODE_PEER.split(":")
    metadata = moriio_common.MoRIIOConnectorMetadata()
    metadata.reqs_to_save["r"] = moriio_common.ReqMeta(
        transfer_id="t",
        local_block_ids=[[1], [1]],
        remote_block_ids=[[2], [2]],
        remote_host=host,
        remote_port=0,
        remote_handshake_port=int(port),
        remote_notify_port=100,
        remote_engine_id="",
        tp_size=d_tp,
        remote_dp_size=1,
    )
    return metadata


def _save_every_layer(
    monkeypatch: pytest.MonkeyPatch, rank: RegisteredWorker, d_tp: int
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The prefill rank's ``save_kv_layer`` of each layer for one request to
    a decoder of ``d_tp`` ranks: the writes it schedules and the handshakes
    it starts."""
    worker = rank.worker
    scheduled: list[dict[str, Any]] = []
    handshakes: list[Any] = []
    monkeypatch.setattr(
        worker, "schedule_write_blocks", lambda **kw: scheduled.append(kw)
    )
    monkeypatch.setattr(
        worker, "_background_moriio_handshake", lambda *a: handshakes.append(a)
    )
    worker.moriio_config.transfer_timeout = 0
    metadata = _metadata(d_tp)
    for layer, kv_layer in rank.kv_caches.items():
        worker.save_kv_layer(metadata, layer, kv_layer, None)
    return scheduled, handshakes


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)], ids=lambda v: str(v))
def test_a_state_write_cannot_slice_is_refused_without_raising(
    copying_mori, monkeypatch, llama_model_dir, p_tp, d_tp
) -> None:
    """A state without a conv split, to a decoder of another TP size: the
    prefill rank logs one line naming the layer and both TP sizes once,
    starts no handshake, and fails the request's write: every decode rank it
    writes is told, and its own blocks are released."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector,
    )

    rank = _prefill_rank(monkeypatch, llama_model_dir, p_tp, "short-conv")
    # The connector's own logger: vLLM's loggers need not reach the root.
    logged: list[str] = []
    monkeypatch.setattr(
        moriio_connector.logger,
        "error",
        lambda msg, *args, **_: logged.append(str(msg) % args),
    )
    scheduled, handshakes = _save_every_layer(monkeypatch, rank, d_tp)
    refusals = [line for line in logged if CONV in line]
    assert len(refusals) == 1 and "\n" not in refusals[0]
    assert f"prefill TP {p_tp}" in refusals[0] and f"decode TP {d_tp}" in refusals[0]
    assert handshakes == []
    assert len(scheduled) == len(rank.kv_caches)
    assert all(CONV in (kw["refusal"] or "") for kw in scheduled)

    worker = rank.worker
    fields = dict(scheduled[0])
    del fields["kv_layer"]
    fields["remote_block_ids_hint"] = fields.pop("remote_block_ids")
    task = moriio_common.WriteTask(**fields, event=types.SimpleNamespace())
    notified: list[tuple[str, int, str]] = []
    monkeypatch.setattr(
        worker.moriio_wrapper,
        "send_notify",
        lambda tid, host, port, message_type="", **_: notified.append(
            (tid, port, message_type)
        ),
        raising=False,
    )
    writer = worker._writer
    allocation = moriio_common.RemoteAllocInfo(block_ids=[[2], [2]])
    monkeypatch.setattr(writer, "_get_remote_alloc_info", lambda _: allocation)
    released: list[str] = []
    monkeypatch.setattr(writer, "_mark_request_done", released.append)
    writer._execute_write_task(task)
    assert sorted(notified) == [
        ("t", 100 + tp_rank, "write_failed") for tp_rank in range(d_tp)
    ]
    assert released == ["t"]


@pytest.mark.parametrize("kind", ["plain", "short-conv"])
def test_equal_tp_and_sliceable_layers_write(
    copying_mori, monkeypatch, llama_model_dir, kind
) -> None:
    """Equal TP sizes, or layers WRITE slices between unequal ones: the
    prefill rank starts its handshake and schedules no refusal."""
    p_tp, d_tp = (1, 2) if kind == "plain" else (1, 1)
    rank = _prefill_rank(monkeypatch, llama_model_dir, p_tp, kind)
    scheduled, handshakes = _save_every_layer(monkeypatch, rank, d_tp)
    assert len(handshakes) == len(rank.kv_caches)
    assert scheduled == [] or all(kw["refusal"] is None for kw in scheduled)
