"""Patch 0053: a WRITE decoder keeps a bounded number of write completions
that no request of its rank maps.

The decoder's worker keeps a ``write_done`` whose transfer id it does not
map yet for a later step (the notify can overtake the step that maps it).
A report no request ever maps (a late or repeated report of a transfer the
decoder no longer maps) was kept for the life of the process. The decoder
is a real WRITE-mode ``MoRIIOConnectorWorker`` registering the KV cache
tensors vLLM lays out, over stubbed mori; the reports go through its real
``MoRIIOWrapper`` message handling.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common,
    moriio_connector,
    moriio_engine,
)

from tests.patches.builders import (
    Region,
    RegisteredWorker,
    _role,
    full_attention_spec,
    make_vllm_config,
    moriio_kv_transfer_config,
    register_worker,
)

B = 16
LAYER = "model.layers.0.self_attn.attn"
BOUND = 8
"""The bound the tests set, so that they pass it with a few reports."""


class _Wrapper(moriio_engine.MoRIIOWrapper):
    """vLLM's MoRIIOWrapper with mori's registration stubbed."""

    def __init__(self, **_: Any) -> None:
        super().__init__()

    def set_moriio_engine(self, engine: Any) -> None:
        pass

    def set_backend_type(self, *_: Any, **__: Any) -> None:
        pass

    def register_local_tensor(self, tensor: torch.Tensor) -> Region:
        return Region(tensor)

    def get_agent_metadata(self) -> bytes:
        return b""


@pytest.fixture
def decoder(
    copying_mori: None, monkeypatch: pytest.MonkeyPatch, llama_model_dir: Path
) -> RegisteredWorker:
    """A WRITE decoder's worker whose bound on unmatched completions is
    ``BOUND``."""
    monkeypatch.setattr(moriio_connector, "MoRIIOWrapper", _Wrapper)
    monkeypatch.setattr(
        moriio_connector, "_MAX_UNMATCHED_WRITE_COMPLETIONS", BOUND, raising=False
    )
    vllm_config = make_vllm_config(
        llama_model_dir,
        moriio_kv_transfer_config("kv_consumer", read_mode=False),
        block_size=B,
    )
    return register_worker(
        vllm_config, {LAYER: full_attention_spec(B)}, "LBNHC", "127.0.0.1:decode"
    )


def _step(worker: Any, mapping: dict[str, str], reports: list[str]) -> set[str]:
    """One decoder step: the scheduler's mapping reaches the worker, the
    prefillers' ``write_done`` reports arrive, the worker reports what it
    received."""
    worker.start_load_kv(
        types.SimpleNamespace(
            transfer_id_to_request_id=dict(mapping), expired_write_transfers=[]
        )
    )
    with _role(moriio_common, moriio_common.ROLE.CONSUMER):
        for transfer_id in reports:
            worker.moriio_wrapper._handle_message(
                msgpack.dumps(
                    {"type": "write_done", "transfer_id": transfer_id, "num_writers": 1}
                )
            )
    results = worker.get_transfer_results()
    assert results.failed_recving == set()
    return set(results.finished_recving)


def test_completions_no_request_maps_are_bounded(decoder: RegisteredWorker) -> None:
    """Reports of transfers no request maps, several per step over many
    steps: the worker keeps at most the bound of them, and still reports a
    mapped request's write."""
    worker = decoder.worker
    for step in range(4 * BOUND):
        reports = [f"stale-{step}-{i}" for i in range(3)]
        assert _step(worker, {}, reports) == set()
        assert len(worker._unmatched_write_completions) <= BOUND
    assert _step(worker, {"t-live": "live"}, ["t-live"]) == {"live"}


def test_oldest_unmatched_completion_is_dropped_first(
    decoder: RegisteredWorker,
) -> None:
    """Past the bound the oldest unmatched report goes: a request mapped
    later than ``BOUND`` newer reports is not reported received (its write
    deadline ends it), one among the newest ``BOUND`` is."""
    worker = decoder.worker
    transfers = [f"t-{i}" for i in range(BOUND + 1)]
    for transfer_id in transfers:
        assert _step(worker, {}, [transfer_id]) == set()
    mapping = {transfer_id: f"req-{transfer_id}" for transfer_id in transfers}
    assert _step(worker, mapping, []) == {
        f"req-{transfer_id}" for transfer_id in transfers[1:]
    }


def test_completion_before_its_mapping_is_reported_once_mapped(
    decoder: RegisteredWorker,
) -> None:
    """A report that overtakes the step mapping its transfer is reported
    received at the step that maps it, once."""
    worker = decoder.worker
    assert _step(worker, {}, ["t-early"]) == set()
    assert _step(worker, {"t-early": "early"}, []) == {"early"}
    assert _step(worker, {"t-early": "early"}, []) == set()
