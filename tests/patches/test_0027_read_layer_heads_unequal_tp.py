"""Patch 0027: READ between unequal TP sizes maps each layer by its own KV heads.

A GQA model's KV heads are split over the TP ranks, and an EAGLE3 drafter
(llama_eagle3.py / deepseek_eagle3.py: 8 KV heads) holds heads of its own
beside the target's. MoRIIO's READ copied one prefill rank's block of each
layer whole, so between unequal TP sizes a layer whose ranks hold other
heads on the two sides was refused when the first request arrived ("holds
4 KV heads per rank here and 8 on the peer"), after the server reported
ready.

Each leg's ranks are real ``MoRIIOConnectorWorker``s over stubbed mori that
register KV cache tensors vLLM's ``allocate_kv_cache`` lays out (both KV
cache layouts), each rank with its TP size's share of the heads; a decode
rank's READ is carried out byte by byte from the prefill ranks' tensors.
The heads each decode rank must hold come from vLLM's sharding rule alone:
rank ``i`` of ``tp`` holds heads ``[i * n, (i + 1) * n)``, ``n = heads //
tp``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common,
    moriio_connector,
)
from vllm.v1.kv_cache_interface import KVCacheSpec

from tests.patches.builders import (
    TINY_LLAMA_CONFIG,
    RegisteredWorker,
    WarningRecords,
    check_eager_handshake_dials_every_holder,
    eager_handshake,
    full_attention_spec,
    paired_sessions,
    random_tp_rank,
    read_as_decode_rank,
    remote_worker_meta,
    write_model_dir,
)

B = 16
MODEL_HEADS, DRAFT_HEADS = 4, 8
"""The target's KV heads (4 x 128) and the EAGLE3 drafter's (8 x 64): the
same page size at every TP size, so both share one KV cache group."""
ATTN, DRAFT = "model.layers.0.self_attn.attn", "drafter.model.layers.0.self_attn.attn"
PEER = "127.0.0.1:7000"
TP_PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2)]


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(
        tmp_path_factory.mktemp("gqa4"),
        {
            **TINY_LLAMA_CONFIG,
            "num_attention_heads": 2 * MODEL_HEADS,
            "num_key_value_heads": MODEL_HEADS,
        },
    )


def specs(
    tp_size: int, draft_heads: int = DRAFT_HEADS, draft_head_size: int = 64
) -> dict[str, KVCacheSpec]:
    return {
        ATTN: full_attention_spec(
            B, num_kv_heads=MODEL_HEADS // tp_size, head_size=128
        ),
        DRAFT: full_attention_spec(
            B, num_kv_heads=draft_heads // tp_size, head_size=draft_head_size
        ),
    }


def _rank(monkeypatch, model_dir, role, tp_size, tp_rank, kv_layout, layer_specs):
    return random_tp_rank(
        monkeypatch, model_dir, role, (tp_size, tp_rank), kv_layout, layer_specs, B
    )


def _leg(monkeypatch, model_dir, role, tp_size, kv_layout) -> list[RegisteredWorker]:
    return [
        _rank(monkeypatch, model_dir, role, tp_size, r, kv_layout, specs(tp_size))
        for r in range(tp_size)
    ]


def _serve_sessions(decoder: RegisteredWorker, prefill: list[RegisteredWorker]) -> None:
    """Sessions of ``decoder`` to the prefill rank each engine key names: a
    ``_tp<r>`` key names rank r, a DP-only key the rank the handshake dials
    (``_remote_tp_rank``). The layers of a rank share one registered region;
    each layer's offset in the peer's is the one its handshake advertises."""
    worker = decoder.worker

    def built(engine_id: str) -> tuple[list[Any], Any]:
        match = re.search(r"_tp(\d+)$", engine_id)
        source = prefill[
            int(match.group(1)) if match else worker._remote_tp_rank(len(prefill))
        ]
        sessions = paired_sessions(worker, source.worker)
        meta = remote_worker_meta(source.worker)
        meta.layer_offsets = source.worker.kv_layer_mr_offset
        return sessions, meta

    worker._get_built_session = built
    worker._remote_layer_mr_offset = lambda layer, meta, _: meta.layer_offsets[layer]


def _heads(rank: RegisteredWorker, layer: str, block: int) -> torch.Tensor:
    """A block of ``layer`` by head: the CPU attention backend lays a layer
    out (blocks, heads, tokens, K|V) in both KV cache layouts."""
    cache = rank.kv_caches[layer]
    heads = rank.worker.layer_to_spec[layer].num_kv_heads
    assert cache.shape[:2] == (rank.worker.num_blocks, heads), cache.shape
    return cache[block].view(torch.uint8)


def _global_heads(leg: list[RegisteredWorker], layer: str, block: int) -> torch.Tensor:
    """Every KV head of ``layer`` in ``block``, gathered over the ranks."""
    return torch.cat([_heads(rank, layer, block) for rank in leg])


@pytest.mark.parametrize("kv_layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS, ids=lambda v: str(v))
def test_each_decode_rank_reads_its_kv_heads_of_every_layer(
    copying_mori, monkeypatch, gqa_model_dir, p_tp, d_tp, kv_layout
) -> None:
    """Every decode rank's block ends up holding exactly its own KV heads of
    the target's layer and of the drafter's, read from the prefill ranks
    that hold them; no other byte of the decoder's cache changes."""
    prefill = _leg(monkeypatch, gqa_model_dir, "kv_producer", p_tp, kv_layout)
    decode = _leg(monkeypatch, gqa_model_dir, "kv_consumer", d_tp, kv_layout)
    local_block, remote_block = 2, 3
    want = {layer: _global_heads(prefill, layer, remote_block) for layer in specs(1)}
    for d, rank in enumerate(decode):
        before = {layer: rank.kv_caches[layer].clone() for layer in specs(1)}
        _serve_sessions(rank, prefill)
        read_as_decode_rank(rank.worker, d, [[local_block]], [[remote_block]], p_tp)
        for layer, heads in want.items():
            got = _heads(rank, layer, local_block)
            mine = heads.chunk(d_tp, dim=0)[d]
            assert torch.equal(got, mine), f"decode rank {d}: {layer}"
            expected = before[layer].clone()
            expected[local_block] = rank.kv_caches[layer][local_block]
            assert torch.equal(
                rank.kv_caches[layer].view(torch.uint8),
                expected.view(torch.uint8),
            ), f"decode rank {d}: {layer} changed outside its block"


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (4, 2)], ids=lambda v: str(v))
def test_eager_handshake_reaches_every_holder_of_the_heads(
    copying_mori, monkeypatch, gqa_model_dir, p_tp, d_tp
) -> None:
    """With more prefill than decode ranks, the handshake before the forward
    pass reaches each prefill rank holding a share of the decode rank's KV
    heads, so that no read handshakes on the read path."""
    decode = _leg(monkeypatch, gqa_model_dir, "kv_consumer", d_tp, "LBNHC")
    check_eager_handshake_dials_every_holder(monkeypatch, decode, p_tp)


def test_unsplittable_drafter_heads_are_refused_at_the_handshake(
    copying_mori, monkeypatch, gqa_model_dir
) -> None:
    """Three drafter heads cannot be split over two prefill ranks: the
    decoder's handshake refuses before it dials the peer, in one line
    naming READ (not WRITE, whose mapping it shares), the layer and both TP
    sizes, and the eager handshake before the forward pass reports that
    line once: raised out of the step, or in one ERROR line while the
    step's READs from the peer are recomputed."""
    rank = _rank(
        monkeypatch,
        gqa_model_dir,
        "kv_consumer",
        1,
        0,
        "LBNHC",
        {
            ATTN: full_attention_spec(B, num_kv_heads=MODEL_HEADS, head_size=96),
            DRAFT: full_attention_spec(B, num_kv_heads=3, head_size=128),
        },
    )

    def dial(*_: Any, **__: Any) -> Any:
        raise AssertionError("the handshake dialed the peer")

    monkeypatch.setattr(moriio_connector, "zmq_ctx", dial)
    with pytest.raises(ValueError) as refused:
        rank.worker._moriio_handshake("127.0.0.1", 7000, 2, PEER)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("MoRIIO READ ") and "WRITE" not in message, message
    assert DRAFT in message
    assert "tp_size=2" in message and "tp_size=1" in message

    errors = WarningRecords()
    errors.setLevel(logging.ERROR)
    logger = logging.getLogger(moriio_connector.__name__)
    logger.addHandler(errors)
    try:
        eager_handshake(monkeypatch, rank.worker, 2)
    except moriio_common.HandshakeError as exc:
        failed = [str(exc)]
    else:
        failed = [r.getMessage() for r in errors.records if PEER in r.getMessage()]
    finally:
        logger.removeHandler(errors)
    assert len(failed) == 1 and "\n" not in failed[0]
    assert message in failed[0]
