"""Every generated `vllm serve` line parses with vLLM's own CLI into an engine
config whose kv_transfer_config the installed MoRIIO code accepts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

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

from tests.e2e.conftest import EXAMPLES, LLAMA_TP8
from vllm_overlay.e2e.config import (
    ConfigError,
    RunConfig,
    Speculative,
    decode_config,
    load_config,
)
from vllm_overlay.e2e.servers import Server, serve_command, servers


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


def serve_lines(config: RunConfig) -> dict[str, list[str]]:
    return {s.role: serve_command(config, s) for s in servers(config)}


def with_sides(config: RunConfig, **kw: object) -> RunConfig:
    legs = {
        leg: msgspec.structs.replace(getattr(config, leg), **kw)
        for leg in ("prefill", "decode")
    }
    return msgspec.structs.replace(config, **legs)


@pytest.mark.parametrize("dcp", [1, 2])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_serve_line_builds_moriio_read_config(
    local_example: RunConfig, role: str, dcp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = with_sides(local_example, dcp=dcp)
    server: Server = servers(config, role)[0]  # type: ignore[arg-type]
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


def test_the_moriio_timeouts_reach_vllms_config(
    local_example: RunConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # recv_abort_timeout (and the other timeouts) from [moriio] reach the
    # pinned MoRIIOConfig through the generated --kv-transfer-config.
    moriio = msgspec.structs.replace(
        local_example.moriio,
        transfer_timeout=41.0, defer_timeout=42.0, recv_abort_timeout=43.0,
    )  # fmt: skip
    config = msgspec.structs.replace(local_example, moriio=moriio)
    vllm_config = engine_config(serve_lines(config)["decode"])
    monkeypatch.setattr(moriio_common, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(
        moriio_common, "get_tensor_model_parallel_world_size", lambda: 8
    )
    mc = moriio_common.MoRIIOConfig.from_vllm_config(vllm_config)
    assert (mc.transfer_timeout, mc.defer_timeout, mc.recv_abort_timeout) == (
        41.0, 42.0, 43.0,
    )  # fmt: skip


def test_the_write_deadline_reaches_the_decoders_connector_config(
    local_example: RunConfig,
) -> None:
    # The WRITE decoder's deadline and quarantine are read by the scheduler
    # connector from kv_connector_extra_config.
    moriio = msgspec.structs.replace(
        local_example.moriio, write_recv_timeout=44.0, write_quarantine_timeout=45.0
    )
    config = msgspec.structs.replace(local_example, moriio=moriio)
    kv = engine_config(serve_lines(config)["decode"]).kv_transfer_config
    assert kv is not None
    extra = kv.kv_connector_extra_config
    assert (extra["write_recv_timeout"], extra["write_quarantine_timeout"]) == (
        44.0,
        45.0,
    )


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_serve_line_builds_the_scheduler_connector(
    local_example: RunConfig, role: str
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


def test_data_parallel_and_expert_parallel_per_side(
    local_example: RunConfig, tmp_path: Path
) -> None:
    # Defect 10: TP/DP per side, parsed by vLLM's own CLI (an MoE model, so
    # that vLLM accepts expert parallelism).
    moe = {
        **LLAMA_TP8,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(moe))
    config = with_sides(local_example, tp=4, dp=2, expert_parallel=True)
    model = msgspec.structs.replace(config.model, path=str(tmp_path))
    config = msgspec.structs.replace(config, model=model)
    vllm_config = engine_config(serve_lines(config)["decode"])
    parallel = vllm_config.parallel_config
    assert parallel.tensor_parallel_size == 4
    assert parallel.data_parallel_size == 2
    assert parallel.enable_expert_parallel is True


@pytest.mark.parametrize(
    ("method", "tokens"),
    [("mtp", 9), ("mtp", 1), ("eagle", 3), ("eagle3", 2), ("dflash", 4),
     ("draft_model", 5), ("dspark", 3), ("ngram", 4)],
)  # fmt: skip
def test_lookahead_slots_agree_with_vllm(method: str, tokens: int) -> None:
    """Our lookahead per speculative method (it decides which lengths fail)
    is what vLLM 0.33.0's VllmConfig.num_lookahead_tokens reserves."""
    from vllm.config import SpeculativeConfig

    spec = SpeculativeConfig.__new__(SpeculativeConfig)
    object.__setattr__(spec, "method", method)
    object.__setattr__(spec, "num_speculative_tokens", tokens)
    object.__setattr__(spec, "num_speculative_tokens_per_batch_size", None)
    # DSpark's drafter samples from the anchor (no fill-in slot).
    anchor = SimpleNamespace(hf_config=SimpleNamespace(sample_from_anchor=True))
    object.__setattr__(spec, "draft_model_config", anchor)
    holder = VllmConfig.__new__(VllmConfig)
    object.__setattr__(holder, "speculative_config", spec)
    object.__setattr__(holder, "diffusion_config", None)
    ours = Speculative(method, tokens).lookahead_slots()
    assert ours == VllmConfig.num_lookahead_tokens.fget(holder)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("read", moriio_common.MoRIIOMode.READ),
        ("write", moriio_common.MoRIIOMode.WRITE),
    ],
)
def test_serve_line_names_the_configured_mode(
    local_example: RunConfig,
    mode: str,
    expected: moriio_common.MoRIIOMode,
) -> None:
    """`moriio.mode` reaches every server as an explicit `read_mode`, which
    vLLM's MoRIIO reads (WRITE when it is unset, so it is always sent)."""
    config = msgspec.structs.replace(
        local_example, moriio=msgspec.structs.replace(local_example.moriio, mode=mode)
    )
    for role in ("prefill", "decode"):
        vllm_config = engine_config(serve_lines(config)[role])
        kv = vllm_config.kv_transfer_config
        assert kv is not None
        assert kv.kv_connector_extra_config["read_mode"] is (mode == "read")
        assert moriio_common.get_moriio_mode(kv) == expected


@pytest.mark.parametrize(
    "moriio", ['mode = "READ"', 'mode = "push"', "read_mode = true"]
)
def test_config_refuses_an_unknown_mode(moriio: str) -> None:
    text = (EXAMPLES / "llama-smoke.toml").read_text()
    text = text.replace('mode = "read"', moriio, 1)
    with pytest.raises(ConfigError, match=r"moriio"):
        decode_config(text, "llama-smoke.toml")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.stem)
def test_examples_name_the_mode(path: Path) -> None:
    """Every example says which mode it runs, not vLLM's default."""
    raw = msgspec.toml.decode(path.read_bytes())
    assert raw["moriio"]["mode"] in ("read", "write")
    assert load_config(path).moriio.mode == raw["moriio"]["mode"]
