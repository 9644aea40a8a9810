"""Patch 0024: hybrid READ between unequal prefill and decode TP sizes.

vLLM shards a KDA/GDN layer's conv sub-projections (Q, K, V) and its SSM
state by head: rank ``i`` of ``tp`` holds the ``i``-th of ``tp`` equal slices
of each. MoRIIO's READ refused every hybrid request between unequal TP sizes
at its first transfer ("heterogeneous-TP mamba/KDA transfer is not supported
yet"), after the server reported ready.

Each leg's ranks are real ``MoRIIOConnectorWorker``s over stubbed mori that
register KV cache tensors vLLM's ``allocate_kv_cache`` lays out (both KV
cache layouts), each rank with its own TP size's state shapes; a decode
rank's READ is carried out byte by byte from the prefill ranks' tensors.
The expected state is assembled here from vLLM's sharding rule alone.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec

from tests.patches.builders import (
    RegisteredWorker,
    check_eager_handshake_dials_every_holder,
    full_attention_spec,
    kda_mamba_spec,
    mamba_state_views,
    paired_sessions,
    random_tp_rank,
    read_as_decode_rank,
    remote_worker_meta,
)

B = 16
HEADS, HEAD_DIM, CONV_KERNEL = 4, 16, 4
"""Four KDA heads: split over up to four TP ranks."""
PAGE = full_attention_spec(B).page_size_bytes
ATTN, KDA = "model.layers.1.self_attn.attn", "model.layers.0.linear_attn"
TP_PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2)]


def kda_spec(tp_size: int) -> MambaSpec:
    """A KDA layer's per-rank state as vLLM shapes it at ``tp_size``."""
    return kda_mamba_spec(
        block_size=B,
        shapes=MambaStateShapeCalculator.kda_state_shape(
            tp_size, HEADS, HEAD_DIM, conv_kernel_size=CONV_KERNEL
        ),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=PAGE,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )


def specs(tp_size: int, hybrid: bool = True) -> dict[str, KVCacheSpec]:
    """The attention layer keeps one KV head on every rank: fewer than the
    model's two (``TINY_LLAMA_CONFIG``), as GLM-5's kpool tail ring beside
    its MLA layers."""
    attention = full_attention_spec(B, num_kv_heads=1, head_size=128)
    return {ATTN: attention, KDA: kda_spec(tp_size)} if hybrid else {ATTN: attention}


def _leg(
    monkeypatch, model_dir, role, tp_size, kv_layout, hybrid=True
) -> list[RegisteredWorker]:
    layer_specs = specs(tp_size, hybrid)
    return [
        random_tp_rank(
            monkeypatch, model_dir, role, (tp_size, r), kv_layout, layer_specs, B
        )
        for r in range(tp_size)
    ]


def _state(rank: RegisteredWorker, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv, ssm) of one slot, as vLLM's ``MambaBase.bind_kv_cache`` views
    them: the conv state is (Q, K, V rows, kernel - 1) dim-first."""
    conv, ssm = mamba_state_views(rank.kv_caches[KDA], rank.worker.layer_to_spec[KDA])
    return conv[slot], ssm[slot]


def _global_state(
    leg: list[RegisteredWorker], slot: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The whole layer's state of ``slot``: each of Q, K, V and the SSM heads
    gathered over the ranks in rank order."""
    parts: list[list[torch.Tensor]] = [[], [], []]
    ssm = []
    for rank in leg:
        conv, rank_ssm = _state(rank, slot)
        for i, part in enumerate(conv.chunk(3, dim=0)):
            parts[i].append(part)
        ssm.append(rank_ssm)
    return [torch.cat(p) for p in parts], torch.cat(ssm)


def _serve_sessions(
    decoder: RegisteredWorker,
    prefill: list[RegisteredWorker],
    stub_attention: bool = True,
) -> list[str]:
    """Sessions of ``decoder`` to the prefill rank each engine key names: a
    ``_tp<r>`` key names rank r, a DP-only key the rank the handshake dials
    (``_remote_tp_rank``). Returns the keys asked for."""
    asked: list[str] = []
    worker = decoder.worker

    def built(engine_id: str) -> tuple[list[Any], Any]:
        asked.append(engine_id)
        match = re.search(r"_tp(\d+)$", engine_id)
        source = prefill[
            int(match.group(1)) if match else worker._remote_tp_rank(len(prefill))
        ]
        return paired_sessions(worker, source.worker), remote_worker_meta(source.worker)

    worker._get_built_session = built
    if stub_attention:
        worker._compute_read_attention_offsets = lambda *a, **k: ([], [], [])
    return asked


@pytest.mark.parametrize("kv_layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS, ids=lambda v: str(v))
def test_each_decode_rank_reads_its_heads_of_the_state(
    copying_mori, monkeypatch, llama_model_dir, p_tp, d_tp, kv_layout
) -> None:
    """Every decode rank's state slot ends up holding exactly its heads'
    slice of the prefill ranks' state (each conv sub-projection and the SSM
    state), read from the prefill ranks that hold them; no other byte of
    the decoder's cache changes, and every holder is released."""
    prefill = _leg(monkeypatch, llama_model_dir, "kv_producer", p_tp, kv_layout)
    decode = _leg(monkeypatch, llama_model_dir, "kv_consumer", d_tp, kv_layout)
    local_slot, remote_slot = 5, 3
    want_parts, want_ssm = _global_state(prefill, remote_slot)
    for d, rank in enumerate(decode):
        before = rank.buffer.clone()
        _serve_sessions(rank, prefill)
        read_as_decode_rank(
            rank.worker, d, [[1], [local_slot]], [[1], [remote_slot]], p_tp
        )
        conv, ssm = _state(rank, local_slot)
        for got, whole in zip(conv.chunk(3, dim=0), want_parts, strict=True):
            want = whole.chunk(d_tp, dim=0)[d]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        want = want_ssm.chunk(d_tp, dim=0)[d]
        assert torch.equal(ssm.view(torch.uint8), want.view(torch.uint8))
        # Only the state slot changed.
        changed = (rank.buffer != before).nonzero().flatten()
        conv_all, ssm_all = _state(rank, local_slot)
        slot_bytes = {
            t.data_ptr() - rank.buffer.data_ptr() + i
            for t in (conv_all, ssm_all)
            for i in range(t.numel() * t.element_size())
        }
        assert set(changed.tolist()) <= slot_bytes
        holders = range(
            d * p_tp // d_tp, max(d * p_tp // d_tp + 1, (d + 1) * p_tp // d_tp)
        )
        assert sorted(rank.worker._recving_transfers_callback_addr[f"r{d}"][1]) == [
            str(100 + h) for h in holders
        ]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (4, 2)], ids=lambda v: str(v))
def test_eager_handshake_reaches_every_holder_of_the_state(
    copying_mori, monkeypatch, llama_model_dir, p_tp, d_tp
) -> None:
    """With more prefill than decode ranks, the handshake before the forward
    pass reaches each prefill rank holding a share of the decode rank's
    heads, so that no read handshakes on the read path."""
    decode = _leg(monkeypatch, llama_model_dir, "kv_consumer", d_tp, "LBNHC")
    check_eager_handshake_dials_every_holder(monkeypatch, decode, p_tp)


@pytest.mark.parametrize("kv_layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)], ids=lambda v: str(v))
def test_a_layer_with_one_head_on_every_rank_is_read_whole(
    copying_mori, monkeypatch, llama_model_dir, p_tp, d_tp, kv_layout
) -> None:
    """An attention layer holding as many KV heads per rank on both sides is
    replicated: its pages are read whole between unequal TP sizes, although
    the model's own KV heads are split."""
    prefill = _leg(monkeypatch, llama_model_dir, "kv_producer", p_tp, kv_layout, False)
    decode = _leg(monkeypatch, llama_model_dir, "kv_consumer", d_tp, kv_layout, False)
    local_block, remote_block = 2, 3
    for d, rank in enumerate(decode):
        before = rank.kv_caches[ATTN].clone()
        _serve_sessions(rank, prefill, stub_attention=False)
        read_as_decode_rank(rank.worker, d, [[local_block]], [[remote_block]], p_tp)
        got = rank.kv_caches[ATTN]
        dim = got.shape.index(rank.worker.num_blocks)
        source = prefill[rank.worker._remote_tp_rank(p_tp)].kv_caches[ATTN]
        expected = before.clone()
        expected.select(dim, local_block).copy_(source.select(dim, remote_block))
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
