"""Every generated `vllm serve` line parses with vLLM's own CLI into an engine
config whose kv_transfer_config the installed MoRIIO code accepts."""

from __future__ import annotations

import argparse

import msgspec
import pytest
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common,
    moriio_connector,
)
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

from vllm_overlay.e2e.config import PairConfig, Server
from vllm_overlay.e2e.plan import build_plan


def parse_serve(argv: list[str]) -> argparse.Namespace:
    """``vllm serve ...`` through the parser the `vllm` CLI builds."""
    assert argv[:2] == ["vllm", "serve"], argv
    parser = FlexibleArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(sub)
    args = parser.parse_args(argv[1:])
    # What ServeSubcommand.cmd does with the positional model.
    args.model = args.model_tag
    cmd.validate(args)
    return args


def engine_config(argv: list[str]) -> VllmConfig:
    args = parse_serve(argv)
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def serve_lines(config: PairConfig) -> dict[str, list[str]]:
    plan = build_plan(config)
    return {
        s.role: s.inner
        for s in plan.setup
        if s.action == "start" and s.role != "router"
    }


def with_dcp(config: PairConfig, dcp: int) -> PairConfig:
    legs = {
        leg: msgspec.structs.replace(getattr(config, leg), dcp=dcp)
        for leg in ("prefill", "decode")
    }
    return msgspec.structs.replace(config, **legs)


@pytest.mark.parametrize("dcp", [1, 2])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_serve_line_builds_moriio_read_config(
    local_example: PairConfig, role: str, dcp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = with_dcp(local_example, dcp)
    server: Server = getattr(config, role)
    vllm_config = engine_config(serve_lines(config)[role])

    assert vllm_config.parallel_config.tensor_parallel_size == server.tp
    assert vllm_config.parallel_config.decode_context_parallel_size == dcp
    assert vllm_config.cache_config.block_size == config.model.block_size
    assert vllm_config.model_config.max_model_len == config.model.max_model_len
    kv = vllm_config.kv_transfer_config
    assert kv is not None
    assert kv.kv_connector == "MoRIIOConnector"
    assert kv.kv_role == ("kv_producer" if role == "prefill" else "kv_consumer")
    assert moriio_common.get_moriio_mode(kv) == moriio_common.MoRIIOMode.READ

    # MoRIIOConfig reads the TP rank from the (uninitialised here) process
    # group; rank 3 of the configured TP size stands in for a worker.
    monkeypatch.setattr(moriio_common, "get_tensor_model_parallel_rank", lambda: 3)
    monkeypatch.setattr(
        moriio_common, "get_tensor_model_parallel_world_size", lambda: server.tp
    )
    mc = moriio_common.MoRIIOConfig.from_vllm_config(vllm_config)
    assert mc.read_mode is True
    assert mc.proxy_ip == config.router.address
    assert mc.proxy_ping_port == config.router.proxy_ping_port
    assert mc.http_port == server.http_port
    assert mc.handshake_port == server.handshake_port
    assert mc.notify_port == server.notify_port + 3
    assert mc.local_ip == server.address
    assert mc.backend == config.moriio.backend


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_serve_line_builds_the_scheduler_connector(
    local_example: PairConfig, role: str
) -> None:
    vllm_config = engine_config(serve_lines(local_example)[role])
    spec = FullAttentionSpec(
        block_size=local_example.model.block_size,
        num_kv_heads=2,
        head_size=16,
        dtype=vllm_config.model_config.dtype,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    with set_current_vllm_config(vllm_config):
        connector = moriio_connector.MoRIIOConnector(
            vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
        )
    assert connector.connector_scheduler is not None
    assert connector.connector_worker is None
