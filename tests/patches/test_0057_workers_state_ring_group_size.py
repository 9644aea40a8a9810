"""The workers tell the scheduler-side connector each ring's group size.

A ring (``CircularBufferSpec``) whose open compression group is empty when
the decoder computes the last prompt token N - 1 holds no row it reads, and
moves no page where the scheduler knows the group size. vLLM 0.34.0's
spec does not state it; Qwen4 exp's ring layer does (``QSARawKeyCache.
compress_ratio``). Each worker's connector states, per ring group, the group
size its ring layers state in its handshake metadata, which vLLM's engine
core hands to the scheduler-side connector at start. The ring layers here
are vLLM's own, built as its model code builds them: they register in the
worker's static forward context themselves.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.request import RequestStatus

from tests.patches.builders import (
    B,
    build_write_pair,
    connector_pair,
    full_attention_spec,
    kda_mamba_spec,
    make_kv_cache_blocks,
    make_kv_cache_config,
    make_request,
    make_scheduler_output,
    prompt,
)
from tests.patches.test_0009_rings_and_wrapped_state import _configs
from tests.patches.test_0047_skip_group_holding_no_state import ATTN, RATIO, STATE
from tests.patches.test_0054_workers_state_group_least_ratio import (
    _hand_over,
    _worker_metadata,
)

RING = "model.layers.3.self_attn.raw_key_cache"


def _qsa_ring(vllm_config: Any, name: str) -> Any:
    """Qwen4 exp's QSA ring layer, as its indexer builds it
    (qwen4_exp/{amd,nvidia}/qsa_indexer.py)."""
    from vllm.models.qwen4_exp.common.qsa_indexer import QSARawKeyCache

    with set_current_vllm_config(vllm_config):
        return QSARawKeyCache(
            head_size=128,
            dtype=torch.bfloat16,
            cache_rope_positions=False,
            prefix=name,
            cache_config=vllm_config.cache_config,
            compress_ratio=RATIO,
            vllm_config=vllm_config,
        )


def _deepseek_ring(vllm_config: Any, name: str) -> Any:
    """DeepSeek-V4.1's compressor ring layer, which states no group size."""
    from vllm.models.deepseek_v41.compressor import CompressorStateCache

    with set_current_vllm_config(vllm_config):
        return CompressorStateCache(state_dim=256, dtype=torch.float32, prefix=name)


def _ring_groups(
    vllm_config: Any, rings: list[str], build: Any = _qsa_ring
) -> list[tuple[list[str], KVCacheSpec]]:
    """A QSA model's groups, the ring layers registered in ``vllm_config``'s
    static forward context; the ring group's spec is its layers' own."""
    layers = [build(vllm_config, name) for name in rings]
    ring = layers[0].get_kv_cache_spec(vllm_config)
    return [
        ([ATTN], full_attention_spec(B)),
        (rings, ring),
        ([STATE], kda_mamba_spec(B)),
    ]


def _ring_worker(
    vllm_config: Any, rings: list[str], build: Any = _qsa_ring
) -> KVCacheConfig:
    return make_kv_cache_config(_ring_groups(vllm_config, rings, build))


def _tables(config: KVCacheConfig, request: Any) -> list[list[int]]:
    """A leg's tables for ``request``'s prompt from vLLM's KV cache manager:
    one ring block per request."""
    manager = KVCacheManager(
        config,
        max_model_len=8192,
        scheduler_block_size=B,
        hash_block_size=B,
        enable_caching=False,
    )
    assert manager.allocate_slots(request, request.num_prompt_tokens) is not None
    return [list(t) for t in manager.get_block_ids(request.request_id)]


def _read_ring_pages(
    model_dir: Path,
    n: int,
    rings: tuple[str, ...] = (RING,),
    tp: int = 1,
    build: Any = _qsa_ring,
    other: tuple[int | None, ...] | None = None,
) -> list[int]:
    """The decoder's ring pages READ fills for N = n, its scheduler told by
    ``tp`` workers (the last stating ``other`` ring sizes if given; none
    at ``tp=0``)."""
    configs = _configs(model_dir, 0)
    worker = _ring_worker(configs[1], list(rings), build)
    metadata = _worker_metadata(configs[1], worker)
    workers = [metadata] * tp
    if other is not None and metadata is not None:
        workers[-1] = replace(metadata, ring_group_size=other)
    scheduler = generate_scheduler_kv_cache_config([worker])
    p_conn, d_conn = connector_pair(configs, scheduler)
    _hand_over(d_conn, workers)
    rid = f"qsa-{n}-{tp}"
    prefill = make_request(rid, n, {"do_remote_decode": True, "transfer_id": rid})
    p_conn.on_new_request(prefill)
    p_tables = _tables(scheduler, prefill)
    prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p_conn.request_finished_all_groups(prefill, tuple(p_tables))
    assert delay and params is not None
    decode = make_request(f"{rid}-d", n, params)
    external, _ = d_conn.get_num_new_matched_tokens(decode, 0)
    d_tables = _tables(scheduler, decode)
    assert len(d_tables[1]) == 1
    d_conn.update_state_after_alloc(decode, make_kv_cache_blocks(d_tables), external)
    meta = d_conn.build_connector_meta(make_scheduler_output())
    # Payload order: the attention groups in group order, then the state.
    return list(meta.reqs_to_recv[decode.request_id].local_block_ids[1])


def _written_ring(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, build: Any = _qsa_ring
) -> Any:
    spec_config = _configs(model_dir, 0)[1]
    groups = _ring_groups(spec_config, [RING], build)
    pair = build_write_pair(model_dir, groups, B, monkeypatch)
    decode = pair.legs.decode
    worker = _ring_worker(decode.vllm_config, [RING], build)
    _hand_over(decode.connector, [_worker_metadata(decode.vllm_config, worker)])

    def ring_pairs(n: int) -> list[tuple[int, int]]:
        write = pair.write(prompt(n, n))
        assert write.notices == []
        return list(write.pairs_by_layer.get(RING, []))

    return ring_pairs


# N - 1 a multiple of the group size: the open group is empty.
@pytest.mark.parametrize("n", [RATIO + 1, 641])
def test_read_skips_a_ring_its_workers_state_empty(
    stub_mori: None, llama_model_dir: Path, n: int
) -> None:
    assert _read_ring_pages(llama_model_dir, n) == []


@pytest.mark.parametrize("n", [RATIO + 1, 129])
def test_write_skips_a_ring_its_workers_state_empty(
    stub_mori: None,
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    n: int,
) -> None:
    assert _written_ring(llama_model_dir, monkeypatch)(n) == []


def test_read_skips_a_group_of_two_rings_at_two_ranks(
    stub_mori: None, llama_model_dir: Path
) -> None:
    rings = (RING, "model.layers.7.self_attn.raw_key_cache")
    assert _read_ring_pages(llama_model_dir, RATIO + 1, rings, tp=2) == []


@pytest.mark.parametrize("n", [2, RATIO + 2, 640])
def test_read_reads_a_ring_whose_open_group_holds_rows(
    stub_mori: None, llama_model_dir: Path, n: int
) -> None:
    moved = _read_ring_pages(llama_model_dir, n)
    assert len(moved) == 1 and moved == _read_ring_pages(llama_model_dir, n, tp=0)


def test_write_writes_a_ring_whose_open_group_holds_rows(
    stub_mori: None, llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    [(prefill_page, decode_page)] = _written_ring(llama_model_dir, monkeypatch)(
        RATIO + 2
    )
    assert 0 not in (prefill_page, decode_page)


def test_a_ring_whose_layers_state_no_group_size_moves_as_before(
    stub_mori: None, llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert len(_read_ring_pages(llama_model_dir, 17, build=_deepseek_ring)) == 1
    assert len(_written_ring(llama_model_dir, monkeypatch, _deepseek_ring)(17)) == 1


def test_a_ring_layer_missing_from_the_forward_context_moves_as_before(
    stub_mori: None, llama_model_dir: Path
) -> None:
    configs = _configs(llama_model_dir, 0)
    worker = _ring_worker(configs[1], [RING])
    # A second ring layer of the group the worker holds no layer object of.
    ring_group = worker.kv_cache_groups[1]
    ring_group.layer_names.append("model.layers.7.self_attn.raw_key_cache")
    assert _worker_metadata(configs[1], worker) is None


def test_a_ring_some_worker_does_not_state_moves_as_before(
    stub_mori: None, llama_model_dir: Path
) -> None:
    other = (None, None, None)
    assert len(_read_ring_pages(llama_model_dir, RATIO + 1, tp=2, other=other)) == 1
