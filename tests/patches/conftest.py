"""Fixtures for the per-patch tests: local model folders (config.json only),
MTP configs for both legs of a READ pair, and the mori transfer engine
stubbed at its boundary for the real worker.

The builders they use live in ``builders.py``.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.patches.builders import (
    MTP,
    TINY_DEEPSEEK_MTP_CONFIG,
    TINY_LLAMA_CONFIG,
    B,
    CopyingWrapper,
    FakeWrapper,
    Layout,
    LegPair,
    WarningRecords,
    leg_pair_cache,
    make_vllm_config,
    moriio_kv_transfer_config,
    shut_down_workers,
    write_model_dir,
)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The core patches' tests (core/) need their core module loaded from a
    tree (``--core-dir``, as `vllm-overlay removable` runs them); the suite,
    on the installed vLLM, leaves them out."""
    if collection_path == Path(__file__).parent / "core":
        return config.getoption("--core-dir", default=None) is None or None
    return None


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("llama"), TINY_LLAMA_CONFIG)


@pytest.fixture(scope="session")
def deepseek_mtp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(
        tmp_path_factory.mktemp("deepseek_mtp"), TINY_DEEPSEEK_MTP_CONFIG
    )


@pytest.fixture(scope="module")
def leg_pairs(llama_model_dir: Path) -> Callable[[Layout], LegPair]:
    """READ producer and consumer connectors per layout, built once."""
    return leg_pair_cache(llama_model_dir)


@pytest.fixture(scope="module")
def mtp_vllm_configs(deepseek_mtp_model_dir: Path):
    return (
        make_vllm_config(
            deepseek_mtp_model_dir,
            moriio_kv_transfer_config("kv_producer"),
            block_size=B,
            speculative_config=MTP,
        ),
        make_vllm_config(
            deepseek_mtp_model_dir,
            moriio_kv_transfer_config("kv_consumer"),
            block_size=B,
            speculative_config=MTP,
        ),
    )


@pytest.fixture
def connector_warnings() -> Iterator[list[logging.LogRecord]]:
    """The MoRIIO connector's warnings, from its own logger: vLLM's logging
    config stops propagation at the ``vllm`` logger, so a root-level capture
    sees nothing once another test in the process has configured it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector as mc,
    )

    handler = WarningRecords()
    log = logging.getLogger(mc.__name__)
    log.addHandler(handler)
    yield handler.records
    log.removeHandler(handler)


@pytest.fixture
def stub_mori(monkeypatch: pytest.MonkeyPatch) -> None:
    # Imported here, not at the top: vLLM's platform is chosen before it loads.
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_common,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector as mc,
    )

    monkeypatch.setattr(mc, "MoRIIO_enabled", True)
    monkeypatch.setattr(mc, "IOEngine", lambda *a, **k: object(), raising=False)
    monkeypatch.setattr(mc, "IOEngineConfig", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(
        mc,
        "BackendType",
        types.SimpleNamespace(XGMI="xgmi", RDMA="rdma"),
        raising=False,
    )
    monkeypatch.setattr(mc, "MoRIIOWrapper", FakeWrapper)
    monkeypatch.setattr(
        mc, "get_world_group", lambda: types.SimpleNamespace(rank=0, local_rank=0)
    )
    monkeypatch.setattr(mc, "get_tp_group", lambda: None)
    monkeypatch.setattr(mc, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(moriio_common, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(
        moriio_common, "get_tensor_model_parallel_world_size", lambda: 1
    )
    stub_backend = types.SimpleNamespace(get_name=lambda: "STUB")
    # The worker asks for its attention backend: get_attn_backend up to vLLM
    # 0.33.0, get_current_attn_backends from 0.34.0.
    monkeypatch.setattr(
        mc, "get_attn_backend", lambda *a, **k: stub_backend, raising=False
    )
    monkeypatch.setattr(
        mc, "get_current_attn_backends", lambda *a, **k: [stub_backend], raising=False
    )
    monkeypatch.setattr(mc.MoRIIOConnectorWorker, "_start_heartbeat", lambda self: None)


@pytest.fixture
def copying_mori(stub_mori: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Stubbed mori whose READs copy bytes between registered tensors; the
    handshake listener only reports ready. Conv states are laid out
    dim-first, where a GDN/KDA conv state splits into its sub-projections."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector as mc,
    )
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setattr(mc, "MoRIIOWrapper", CopyingWrapper)

    def listener(metadata, ready_event, *args: Any) -> None:
        ready_event.set()

    monkeypatch.setattr(
        mc.MoRIIOConnectorWorker, "_moriio_handshake_listener", staticmethod(listener)
    )
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        yield
    finally:
        shut_down_workers()
        mamba_utils.get_conv_state_layout.cache_clear()
