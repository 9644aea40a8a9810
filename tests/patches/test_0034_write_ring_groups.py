"""Patch 0034: WRITE serves circular-buffer ring groups between equal TP
sizes.

GLM-5.3-Flash's kpool tail, DeepSeek-V4.1's compressor ring and Step5's CSA
tail are ``CircularBufferSpec`` groups: one block per request holding the
rows of the still-open compressor group. READ moves them; WRITE refused them
at start. A WRITE prefiller beside Mamba or window groups computes N - 1
prompt tokens, so its ring holds the rows the decoder needs, and it writes
that block into the decoder's. Between unequal TP sizes a ring whose page
the decoder holds otherwise is refused at the prefiller's handshake, in one
line naming the ring and both TP sizes; a ring of the same rows on both
sides is written whole.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
)

from tests.patches.builders import (
    RegisteredWorker,
    build_write_pair,
    full_attention_spec,
    kda_mamba_spec,
    make_kv_cache_config,
    make_scheduler_connector,
    make_vllm_config,
    moriio_kv_transfer_config,
    prompt,
    register_worker,
)
from tests.patches.test_0009_rings_and_wrapped_state import BLOCK, MTP, real_grouping

B = 16
ATTN = "model.layers.1.self_attn.attn"
RING = "model.layers.1.self_attn.tail_cache"


def ring_spec(rows: int = B) -> CircularBufferSpec:
    return CircularBufferSpec(
        block_size=rows,
        num_kv_heads=2,
        head_size=64,
        head_size_v=0,
        dtype=torch.bfloat16,
    )


@pytest.mark.parametrize("num_spec", [0, 1], ids=["no-spec", "mtp"])
def test_write_starts_with_the_real_ring_grouping(
    llama_model_dir: Path, deepseek_mtp_model_dir: Path, num_spec: int
) -> None:
    """GLM-5.3-Flash's grouping (KDA groups, MLA + indexer, the kpool tail
    ring) starts on both WRITE legs."""
    model_dir = deepseek_mtp_model_dir if num_spec else llama_model_dir
    for role in ("kv_producer", "kv_consumer"):
        config = make_vllm_config(
            model_dir,
            moriio_kv_transfer_config(role, read_mode=False),
            block_size=BLOCK,
            speculative_config=MTP if num_spec else None,
        )
        grouping = real_grouping(config, num_spec)
        assert grouping.kinds()[-1] == "ring"
        make_scheduler_connector(config, grouping.scheduler)


def test_write_pairs_the_ring_block_by_position(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside a KDA group the prefiller computes N - 1 tokens; the ring
    group's one block is written into the decoder's ring block, the
    attention group's pages past the decoder's hit."""
    groups: list[tuple[list[str], KVCacheSpec]] = [
        ([ATTN], full_attention_spec(B)),
        (["model.layers.0.linear_attn"], kda_mamba_spec(B)),
        ([RING], ring_spec()),
    ]
    pair = build_write_pair(llama_model_dir, groups, B, monkeypatch)
    for num_tokens, hit in ((17, 0), (100, 0), (100, 48)):
        write = pair.write(prompt(num_tokens, num_tokens), decode_hit_tokens=hit)
        assert write.notices == []
        ring = write.pairs_by_layer[RING]
        prefill_ring, decode_ring = write.prefill_tables[2], write.decode_tables[2]
        assert len(prefill_ring) == len(decode_ring) == 1
        assert ring == [(prefill_ring[0], decode_ring[0])]
        assert 0 not in ring[0]


def _ring_rank(model_dir: Path) -> RegisteredWorker:
    vllm_config = make_vllm_config(
        model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        block_size=B,
    )
    return register_worker(
        vllm_config,
        {ATTN: full_attention_spec(B), RING: ring_spec()},
        "BLNHC",
        "127.0.0.1:kv_producer",
    )


def _write_refusal(worker: Any, decode_tp: int) -> str:
    """Why the prefiller will not write to a decoder of ``decode_tp`` ranks
    whose ring holds other rows: the refusal its handshake with the decoder
    records (where a ring of the same rows is written whole), the one
    it states for that peer before writing, or the one its first
    handshake's mapping raises."""
    if hasattr(worker, "_check_write_serves_peer"):
        layouts = dict(worker.kv_head_layouts)
        layouts[RING] = layouts[RING]._replace(num_tokens=2 * layouts[RING].num_tokens)
        peer = types.SimpleNamespace(
            kv_head_layouts={n: x.to_wire() for n, x in layouts.items()}
        )
        worker._check_write_serves_peer(peer, decode_tp)
        return str(worker._write_peer_refusal(decode_tp))
    if hasattr(worker, "_write_peer_refusal"):
        refusal = worker._write_peer_refusal(decode_tp)
        assert refusal is not None
        return str(refusal)
    with pytest.raises(moriio_common.HandshakeError) as refused:
        worker._write_tp_mapping(decode_tp)
    return str(refused.value)


@pytest.mark.parametrize("decode_tp", [2, 4])
def test_unequal_tp_write_of_a_ring_is_refused_at_the_handshake(
    copying_mori: None, llama_model_dir: Path, decode_tp: int
) -> None:
    """Before the prefiller writes to a decoder of another TP size whose
    ring it cannot write, in one line naming the ring and both TP sizes;
    equal TP maps."""
    rank = _ring_rank(llama_model_dir)
    message = _write_refusal(rank.worker, decode_tp)
    assert "\n" not in message
    assert message.startswith("MoRIIO WRITE cannot serve ")
    assert RING in message
    assert f"between prefill TP 1 and decode TP {decode_tp}" in message
    assert rank.worker._write_tp_mapping(1) is not None


def test_write_refuses_a_ring_without_state_or_window_groups(
    llama_model_dir: Path,
) -> None:
    """Guard: with full attention only beside it the prefiller computes
    every prompt token, its ring past the rows the decoder needs: refused
    at start naming the group."""
    config = make_vllm_config(
        llama_model_dir, moriio_kv_transfer_config("kv_producer", read_mode=False)
    )
    groups = [
        KVCacheGroupSpec([ATTN], full_attention_spec(16)),
        KVCacheGroupSpec([RING], ring_spec()),
    ]
    with pytest.raises(NotImplementedError, match="circular-buffer"):
        make_scheduler_connector(config, make_kv_cache_config(groups))
