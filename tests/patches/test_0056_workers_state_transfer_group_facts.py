"""The workers' handshake metadata carries their transfer groups' facts.

Each worker's connector states facts of its transfer groups that its layers
hold and the scheduler's groups do not (the least ``tokens_per_state`` of a
group's layers, a ring's compression group size) in its handshake metadata
(``get_handshake_metadata``), which vLLM's engine core hands to the
scheduler-side connector at start (``set_xfer_handshake_metadata_pp_aware``).
The scheduler skips by them as by the groups' own: a group whose layers hold
no state yet, a ring whose open group is empty. Here the statements are made
to state a fact, whatever the worker's layers hold, and the fact must reach
the scheduler.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

from tests.patches.builders import connector_pair, run_transfer
from tests.patches.test_0009_rings_and_wrapped_state import _configs
from tests.patches.test_0047_skip_group_holding_no_state import COMPRESSED, RATIO
from tests.patches.test_0054_workers_state_group_least_ratio import (
    _hand_over,
    _read_pages,
    _worker_config,
    _worker_metadata,
    _written,
)
from tests.patches.test_0057_workers_state_ring_group_size import (
    RING,
    _read_ring_pages,
    _ring_worker,
)

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"


def _state(
    monkeypatch: pytest.MonkeyPatch,
    least: int | None = None,
    ring: int | None = None,
    raising: bool = True,
) -> None:
    """The worker's statements state ``least`` of the compressed group and
    ``ring`` of the ring group, nothing of any other group."""
    import importlib

    module = importlib.import_module(MODULE)

    def least_tokens_per_state(group: KVCacheGroupSpec) -> int | None:
        return least if any(COMPRESSED in n for n in group.layer_names) else None

    def ring_group_size(group: KVCacheGroupSpec, vllm_config: Any) -> int | None:
        return ring if RING in group.layer_names else None

    monkeypatch.setattr(
        module, "_least_tokens_per_state", least_tokens_per_state, raising=raising
    )
    monkeypatch.setattr(module, "_ring_group_size", ring_group_size, raising=raising)


@pytest.mark.parametrize("n", [2, RATIO])
def test_a_stated_least_ratio_reaches_the_scheduler(
    stub_mori: None, llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    _state(monkeypatch, least=RATIO)
    assert _read_pages(llama_model_dir, n) == []
    assert _read_pages(llama_model_dir, RATIO + 1) != []


def test_a_stated_least_ratio_reaches_a_write_decoders_scheduler(
    stub_mori: None, llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _state(monkeypatch, least=RATIO)
    assert _written(llama_model_dir, monkeypatch, (RATIO,))(2) == []


def test_a_stated_ring_size_reaches_the_scheduler(
    stub_mori: None, llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the statement says, not the ring layer's own size (16): 8.
    _state(monkeypatch, ring=RATIO // 2)
    assert _read_ring_pages(llama_model_dir, RATIO // 2 + 1) == []
    assert len(_read_ring_pages(llama_model_dir, RATIO // 2 + 2)) == 1


def test_the_scheduler_takes_the_least_ratio_and_a_common_ring_size(
    stub_mori: None, llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two workers: 16 and 4 tokens per state -> 4; rings of 8 and 16 -> 16.
    _state(monkeypatch, least=RATIO, ring=RATIO // 2)
    configs = _configs(llama_model_dir, 0)
    stated = _worker_metadata(configs[1], _worker_config((RATIO,)))
    assert stated is not None and stated.least_tokens_per_state[1] == RATIO
    other = replace(stated, least_tokens_per_state=(None, 4, None))
    assert _read_pages_told(llama_model_dir, [stated, other], 4) == []
    assert _read_pages_told(llama_model_dir, [stated, other], 5) != []
    assert len(_read_ring_pages(llama_model_dir, 9, tp=2, other=(None, 16, None))) == 1
    assert _read_ring_pages(llama_model_dir, 17, tp=2, other=(None, 16, None)) == []


def _read_pages_told(model_dir: Path, workers: list[Any], n: int) -> list[int]:
    """The compressed group's pages READ fills for N = n, the decoder's
    scheduler told ``workers``' metadata."""
    configs = _configs(model_dir, 0)
    scheduler = generate_scheduler_kv_cache_config([_worker_config((RATIO,))])
    p_conn, d_conn = connector_pair(configs, scheduler)
    _hand_over(d_conn, workers)
    return run_transfer(p_conn, d_conn, scheduler.kv_cache_groups, n, 0).local[1]


def test_a_worker_stating_nothing_sends_no_metadata(
    stub_mori: None, llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's one metadata slot stays free for another connector.
    _state(monkeypatch, raising=False)
    configs = _configs(llama_model_dir, 0)
    assert _worker_metadata(configs[1], _worker_config((RATIO,))) is None
    assert _worker_metadata(configs[1], _ring_worker(configs[1], [RING])) is None


def test_a_wrapped_connector_sends_no_metadata_whatever_it_states(
    stub_mori: None, llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A MultiConnector returns one of its connectors' metadata to all.
    from vllm.distributed.kv_transfer import kv_transfer_state

    _state(monkeypatch, least=RATIO, ring=RATIO, raising=False)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", object())
    configs = _configs(llama_model_dir, 0)
    assert _worker_metadata(configs[1], _worker_config((RATIO,))) is None
