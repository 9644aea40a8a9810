"""Patch 0032: READ between unequal TP sizes refuses, at the decoder's
handshake, a layer it cannot move.

vLLM sizes some per-rank pages by the TP size: a ring sized to the rank's
attention page (Step5's CSA tail ring) holds fewer, shorter rows at a larger
TP size, and a recurrent state without a conv split (LFM3's ShortConv,
Qwen4-exp's PLE state) is sharded with no slice layout for READ to address.
Copying such a page from a prefill rank of another TP size gives the decoder
wrong bytes; a state without a conv split failed every request at its first
transfer, after the server reported ready.

The decode rank is a real ``MoRIIOConnectorWorker`` over stubbed mori; the
peer's handshake metadata is the one a prefill rank of the other TP size
advertises (its own per-rank specs), served on a stand-in socket.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import msgpack
import msgspec
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common,
    moriio_connector,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec

from tests.patches.builders import (
    RegisteredWorker,
    full_attention_spec,
    kda_mamba_spec,
    random_tp_rank,
)

B = 16
PEER = "127.0.0.1:7000"
ATTN = "model.layers.1.self_attn.attn"
RING = "model.layers.1.self_attn.tail_ring"
CONV = "model.layers.0.short_conv"
PAGE = full_attention_spec(B, num_kv_heads=1, head_size=128).page_size_bytes


def ring_spec(tp_size: int) -> KVCacheSpec:
    """One head whose size is the rank's share of a page (Step5's ring is
    one attention page of its rank, whose KV heads TP splits)."""
    return full_attention_spec(B, num_kv_heads=1, head_size=256 // tp_size)


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
    if kind == "ring":
        return {ATTN: attention, RING: ring_spec(tp_size)}
    if kind == "short-conv":
        return {ATTN: attention, CONV: short_conv_spec(tp_size)}
    return {ATTN: attention}


def _rank(monkeypatch, model_dir, role, tp_size, kind) -> RegisteredWorker:
    return random_tp_rank(
        monkeypatch, model_dir, role, (tp_size, 0), "LBNHC", specs(kind, tp_size), B
    )


def _serve_metadata(monkeypatch, decoder: RegisteredWorker, peer: RegisteredWorker):
    """The handshake's socket answers with ``peer``'s metadata."""
    worker = peer.worker
    metadata = moriio_common.MoRIIOAgentMetadata(
        engine_id=PEER,
        agent_metadata=b"",
        kv_caches_base_addr=[],
        num_blocks=worker.num_blocks,
        block_len=0,
        attn_backend_name="",
        kv_head_layouts={n: x.to_wire() for n, x in worker.kv_head_layouts.items()},
        mamba_state_layouts={
            n: x.to_wire() for n, x in worker.mamba_state_layouts.items()
        },
    )
    frames = [
        [b"", msgspec.msgpack.encode(metadata)],
        [b"", msgpack.dumps({})],
    ]

    class Socket:
        def send(self, _: Any) -> None:
            pass

        def recv_multipart(self) -> list[bytes]:
            return frames.pop(0)

    @contextmanager
    def dial(*_: Any, **__: Any) -> Any:
        yield Socket()

    monkeypatch.setattr(moriio_connector, "zmq_ctx", dial)
    monkeypatch.setattr(
        decoder.worker.moriio_wrapper,
        "register_remote_engine",
        lambda _: PEER,
        raising=False,
    )


@pytest.mark.parametrize("kind", ["ring", "short-conv"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)], ids=lambda v: str(v))
def test_a_layer_read_cannot_move_is_refused_at_the_handshake(
    copying_mori, monkeypatch, llama_model_dir, p_tp, d_tp, kind
) -> None:
    """A layer whose per-rank page differs between the TP sizes (a ring of
    the rank's page) or a state without a conv split: the decoder's
    handshake refuses the peer in one line naming the layer and both TP
    sizes, before any request reads."""
    peer = _rank(monkeypatch, llama_model_dir, "kv_producer", p_tp, kind)
    decoder = _rank(monkeypatch, llama_model_dir, "kv_consumer", d_tp, kind)
    _serve_metadata(monkeypatch, decoder, peer)
    with pytest.raises(moriio_common.HandshakeError) as refused:
        decoder.worker._moriio_handshake("127.0.0.1", 7000, p_tp, PEER)
    message = str(refused.value)
    assert "\n" not in message
    assert (RING if kind == "ring" else CONV) in message
    assert f"prefill TP {p_tp}" in message and f"decode TP {d_tp}" in message
    assert PEER not in decoder.worker.remote_moriio_metadata


@pytest.mark.parametrize("kind", ["plain", "ring", "short-conv"])
def test_equal_tp_and_servable_layers_complete_the_handshake(
    copying_mori, monkeypatch, llama_model_dir, kind
) -> None:
    """Equal TP sizes, or a layer with one replicated head on every rank
    between unequal ones: the handshake completes."""
    d_tp, p_tp = (1, 2) if kind == "plain" else (2, 2)
    peer = _rank(monkeypatch, llama_model_dir, "kv_producer", p_tp, kind)
    decoder = _rank(monkeypatch, llama_model_dir, "kv_consumer", d_tp, kind)
    _serve_metadata(monkeypatch, decoder, peer)
    assert decoder.worker._moriio_handshake("127.0.0.1", 7000, p_tp, PEER) == {PEER}
    assert PEER in decoder.worker.remote_moriio_metadata
