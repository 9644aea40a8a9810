"""The workers tell the scheduler-side connector each group's least ratio.

A group none of whose layers holds a compressed state before the last prompt
token moves no page where the scheduler knows the least
``tokens_per_state`` of the group's layers. vLLM 0.34.0's group does not
state it, and the scheduler's copy of a uniform-type group keeps one layer's
spec. The workers hold every layer's spec: each worker's connector states the
least ratio of every transfer group in its handshake metadata
(``get_handshake_metadata``), which vLLM's engine core hands to the
scheduler-side connector at start (``set_xfer_handshake_metadata_pp_aware``),
before any request. The helpers here hand it over as the engine core does.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
)
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

from tests.patches.builders import (
    B,
    build_write_pair,
    connector_pair,
    full_attention_spec,
    kda_mamba_spec,
    make_kv_cache_config,
    prompt,
    run_transfer,
)
from tests.patches.test_0009_rings_and_wrapped_state import _configs
from tests.patches.test_0047_skip_group_holding_no_state import (
    ATTN,
    COMPRESSED,
    RATIO,
    STATE,
    _compressed_specs,
    _stating,
)


def _groups(ratios: tuple[int, ...]) -> list[tuple[list[str], KVCacheSpec]]:
    compressed = _compressed_specs(*ratios)
    names = (
        list(getattr(compressed, "kv_cache_specs", {})) if len(ratios) > 1 else []
    ) or [COMPRESSED]
    return [
        ([ATTN], full_attention_spec(B)),
        (names, compressed),
        ([STATE], kda_mamba_spec(B)),
    ]


def _worker_config(ratios: tuple[int, ...], stated: bool = True) -> KVCacheConfig:
    """A worker's config; ``stated=False``: as on a vLLM whose groups do not
    state their least ratio (the field cleared where the build has it)."""
    config = make_kv_cache_config(_groups(ratios))
    if not stated:
        for group in config.kv_cache_groups:
            _stating(group, stated=False)
    return config


def _worker_metadata(
    vllm_config: Any, config: KVCacheConfig
) -> KVConnectorHandshakeMetadata | None:
    """The real worker-side connector's handshake metadata."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector import (  # noqa: E501
        MoRIIOConnector,
    )

    with set_current_vllm_config(vllm_config):
        connector = MoRIIOConnector(vllm_config, KVConnectorRole.WORKER, config)
    try:
        return connector.get_handshake_metadata()
    finally:
        connector.shutdown()


def _hand_over(
    scheduler_connector: Any, workers: list[KVConnectorHandshakeMetadata | None]
) -> None:
    """What vLLM's engine core does at start: each worker's metadata keyed by
    (pp_rank, tp_rank), none for a worker that has none."""
    content = {(0, rank): m for rank, m in enumerate(workers) if m is not None}
    scheduler_connector.set_xfer_handshake_metadata_pp_aware(content)


def _read_pages(
    model_dir: Path, n: int, ratios: tuple[int, ...] = (RATIO,), tp: int = 1
) -> list[int]:
    """The decoder's compressed-group pages READ fills for N = n, its
    scheduler told by ``tp`` workers."""
    configs = _configs(model_dir, 0)
    worker = _worker_config(ratios)
    metadata = _worker_metadata(configs[1], worker)
    scheduler = generate_scheduler_kv_cache_config([worker])
    p_conn, d_conn = connector_pair(configs, scheduler)
    _hand_over(d_conn, [metadata] * tp)
    t = run_transfer(p_conn, d_conn, scheduler.kv_cache_groups, n, 0)
    return t.local[1]


def _written(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, ratios: tuple[int, ...]
) -> Any:
    # The scheduler's copy of a uniform-type group keeps its first layer's spec.
    groups = [
        (names, next(iter(getattr(spec, "kv_cache_specs", {}).values()), spec))
        for names, spec in _groups(ratios)
    ]
    pair = build_write_pair(model_dir, groups, B, monkeypatch)
    worker = _worker_config(ratios)
    for leg in (pair.legs.prefill, pair.legs.decode):
        # What the scheduler's copy keeps of the workers' groups.
        for group, kept in zip(
            leg.kv_cache_config.kv_cache_groups, worker.kv_cache_groups, strict=True
        ):
            if hasattr(kept, "min_tokens_per_state"):
                group.min_tokens_per_state = kept.min_tokens_per_state
    decode = pair.legs.decode
    metadata = _worker_metadata(decode.vllm_config, worker)
    _hand_over(decode.connector, [metadata])

    def compressed_pairs(n: int) -> list[tuple[int, int]]:
        write = pair.write(prompt(n, n))
        assert write.notices == []
        layers = [name for name in pair.layers if name.startswith(COMPRESSED)]
        return [p for name in layers for p in write.pairs_by_layer.get(name, [])]

    return compressed_pairs


# N - 1 below the ratio: no layer holds a compressed state.
@pytest.mark.parametrize("n", [2, RATIO])
def test_read_skips_a_group_its_workers_state_holds_no_state(
    stub_mori: None, llama_model_dir: Path, n: int
) -> None:
    assert _read_pages(llama_model_dir, n) == []


@pytest.mark.parametrize("n", [2, RATIO])
def test_write_skips_a_group_its_workers_state_holds_no_state(
    stub_mori: None,
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    n: int,
) -> None:
    assert _written(llama_model_dir, monkeypatch, (RATIO,))(n) == []


def test_read_skips_a_uniform_group_of_one_ratio_at_two_ranks(
    stub_mori: None, llama_model_dir: Path
) -> None:
    # The scheduler's copy keeps one of the two layers' specs.
    assert _read_pages(llama_model_dir, 2, (RATIO, RATIO), tp=2) == []


@pytest.mark.parametrize("n", [RATIO + 1, 129])
def test_read_reads_a_group_holding_a_state(
    stub_mori: None, llama_model_dir: Path, n: int
) -> None:
    assert len(_read_pages(llama_model_dir, n)) == -(-(n - 1) // B)


def test_a_group_of_mixed_ratios_moves_while_one_holds_a_state(
    stub_mori: None, llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scheduler's spec is the ratio-2 layer's; the workers state 1, and
    # the ratio-1 layer holds the state of token 0.
    worker = _worker_config((2, 1))
    scheduler = generate_scheduler_kv_cache_config([worker])
    assert scheduler.kv_cache_groups[1].kv_cache_spec.tokens_per_state == 2
    assert len(_read_pages(llama_model_dir, 2, (2, 1))) == 1
    # Each of the group's two layers is written its one page.
    assert len(set(_written(llama_model_dir, monkeypatch, (2, 1))(2))) == 1


def test_a_model_of_single_token_states_sends_no_metadata(
    stub_mori: None, llama_model_dir: Path
) -> None:
    # Nothing to tell: the engine's one metadata slot stays free for another
    # connector of a MultiConnector.
    config = make_kv_cache_config(
        [([ATTN], full_attention_spec(B)), ([STATE], kda_mamba_spec(B))]
    )
    assert _worker_metadata(_configs(llama_model_dir, 0)[1], config) is None


class _OtherConnectorsMetadata(KVConnectorHandshakeMetadata):
    pass


def test_another_connectors_metadata_moves_as_before(
    stub_mori: None, llama_model_dir: Path
) -> None:
    # A MultiConnector hands every connector the first one's metadata.
    configs = _configs(llama_model_dir, 0)
    worker = _worker_config((RATIO,), stated=False)
    scheduler = generate_scheduler_kv_cache_config([worker])
    p_conn, d_conn = connector_pair(configs, scheduler)
    _hand_over(d_conn, [_OtherConnectorsMetadata()])
    t = run_transfer(p_conn, d_conn, scheduler.kv_cache_groups, 2, 0)
    assert len(t.local[1]) == 1


def test_a_group_some_worker_does_not_state_moves_as_before(
    stub_mori: None, llama_model_dir: Path
) -> None:
    # A worker stating 1 for the attention group and nothing of the others.
    configs = _configs(llama_model_dir, 0)
    worker = _worker_config((RATIO,), stated=False)
    stated = _worker_metadata(configs[1], worker)
    other = (
        None
        if stated is None
        else replace(stated, least_tokens_per_state=(1, None, None))
    )
    scheduler = generate_scheduler_kv_cache_config([worker])
    p_conn, d_conn = connector_pair(configs, scheduler)
    _hand_over(d_conn, [stated, other])
    t = run_transfer(p_conn, d_conn, scheduler.kv_cache_groups, 2, 0)
    assert len(t.local[1]) == 1


def test_a_wrapped_connector_sends_no_metadata(
    stub_mori: None, llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's connector is another one wrapping MoRIIO (a MultiConnector):
    # it returns one of its connectors' metadata to all of them, and NIXL's
    # scheduler side refuses any but its own.
    from vllm.distributed.kv_transfer import kv_transfer_state

    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", object())
    config = _worker_config((RATIO,), stated=False)
    assert _worker_metadata(_configs(llama_model_dir, 0)[1], config) is None
