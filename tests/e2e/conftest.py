"""Shared pieces of the E2E harness tests: the examples, a local model, runs
on 127.0.0.1 with stand-in servers and a fake `docker`."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.e2e.ports import free_port
from tests.repo import REPO
from vllm_overlay import cpuplatform
from vllm_overlay.e2e.config import RunConfig, load_config

cpuplatform.use_in_this_process()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

EXAMPLES = REPO / "examples"
EXAMPLE = EXAMPLES / "llama-smoke.toml"
ALL_EXAMPLES = sorted(EXAMPLES.glob("*.toml"))
FIXTURES = Path(__file__).resolve().parent / "fixtures"
HERE = Path(__file__).resolve().parent
LOOPBACK = "127.0.0.1"
SERIES = "0123abcd4567"
BANNER = f"INFO vllm-moriio-overlay: series {SERIES} (0001-a, 0003-c) on vLLM 0.33.0"

# A Llama-shaped config that TP=8 with DCP=2 accepts: 64 query heads, 4 KV
# heads, tiny hidden size. Only config.json exists; nothing is downloaded.
LLAMA_TP8 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def example_config() -> RunConfig:
    return load_config(EXAMPLE)


@pytest.fixture(scope="session")
def local_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama-tp8")
    (d / "config.json").write_text(json.dumps(LLAMA_TP8))
    return d


@pytest.fixture
def local_example(example_config: RunConfig, local_model: Path) -> RunConfig:
    """The smoke example with the model path pointing at the local config."""
    model = msgspec.structs.replace(example_config.model, path=str(local_model))
    return msgspec.structs.replace(example_config, model=model)


def loopback_config(
    tokenizer: Path | str,
    prefill: int = 1,
    decode: int = 1,
    *,
    kind: str = "vllm-router",
    router_container: bool = False,
    engine: str = "docker",
    with_addresses: bool = True,
    health_s: float = 120,
    **overrides: Any,
) -> RunConfig:
    """A run on 127.0.0.1: free ports everywhere, small checks."""

    def side(n: int) -> dict[str, Any]:
        return {
            "instances": [
                {
                    **({"address": LOOPBACK} if with_addresses else {}),
                    "http_port": free_port(),
                    "handshake_port": free_port(),
                    "notify_port": free_port(),
                }
                for _ in range(n)
            ]
        }

    data: dict[str, Any] = {
        "name": "loop",
        "container": {
            "image": "registry.example.com/overlay:test",
            "engine": engine,
            "cache_dir": "",
        },
        "model": {
            "path": "/models/standin",
            "served_name": "standin",
            "tokenizer": str(tokenizer),
            "max_model_len": 16384,
            "block_size": 64,
        },
        "layout": {"sliding_window": 128},
        "prefill": side(prefill),
        "decode": {
            **side(decode),
            "speculative": {"method": "mtp", "num_speculative_tokens": 9},
        },
        "router": {
            "kind": kind,
            "address": LOOPBACK,
            "bind": LOOPBACK,
            "port": free_port(),
            "proxy_ping_port": free_port(),
            "prometheus_port": free_port(),
            "container": router_container,
        },
        "checks": {
            "max_tokens": 3,
            "sweep_max_len": 320,
            "sweep_min_count": 20,
            "needle_words": [300],
            "prefix_hit_length": 600,
            "prefix_hit_fractions": [0.5],
            "repeat_length": 400,
            "accuracy": {"problems": 0},
        },
        "timeouts": {"health_s": health_s, "poll_s": 0.3, "command_s": 30},
        # One small load cell; NIC counters only where a test gives a root.
        "load": {
            "input_lens": [64],
            "output_len": 4,
            "concurrencies": [2],
            "prompts_per_concurrency": 2,
        },
        "nic": {"counters_root": ""},
    }
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    return msgspec.convert(data, RunConfig)


def write_config(config: RunConfig, path: Path) -> Path:
    """``config`` as a TOML file (TOML has no null: unset fields are left out)."""
    path.write_bytes(msgspec.toml.encode(without_nulls(msgspec.to_builtins(config))))
    return path


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.e2e.tokenizer import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture
def fake_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An `ssh` on PATH that runs the remote command on this machine
    (tests/e2e/fakessh.py); returns the log of its command lines."""
    bin_dir = tmp_path / "ssh-bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "fakessh.py"} "$@"\n')
    ssh.chmod(0o755)
    log = tmp_path / "ssh-calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    return log


def shim_path(bin_dir: Path, name: str, command: str) -> str:
    """A shell script ``name`` in ``bin_dir`` that runs ``command`` with its
    arguments; returns $PATH with ``bin_dir`` first."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\n{command} "$@"\n')
    script.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def fake_docker_path(bin_dir: Path) -> str:
    """$PATH with a `docker` that runs the stand-ins (tests/e2e/fakedocker.py)
    first. -S: no site-packages (the fake needs the standard library only),
    so it starts in milliseconds even on a loaded machine."""
    command = f"exec {sys.executable} -S {HERE / 'fakedocker.py'}"
    return shim_path(bin_dir, "docker", command)


# KV bytes a token the stand-in's NIC counters count, a multiple of the
# counter's 4-byte word.
PER_TOKEN = 1152


def standin_nics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The stand-in's NIC counters under ``tmp_path``, PER_TOKEN bytes a
    token; the config fields that read them."""
    nic_dir = tmp_path / "sys-class-infiniband"
    monkeypatch.setenv("STANDIN_NIC_DIR", str(nic_dir))
    monkeypatch.setenv("STANDIN_NIC_BYTES_PER_TOKEN", str(PER_TOKEN))
    return {"nic__counters_root": str(nic_dir), "model__kv_bytes_per_token": PER_TOKEN}


def without_nulls(value: Any) -> Any:
    """``value`` (builtins) without the None fields: TOML has no null."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


@pytest.fixture
def fake_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A `docker` on PATH that runs stand-ins (tests/e2e/fakedocker.py);
    yields its state directory and removes every "container" left."""
    monkeypatch.setenv("PATH", fake_docker_path(tmp_path / "bin"))
    state = tmp_path / "docker-state"
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(state))
    monkeypatch.setenv("STANDIN_BANNER", BANNER)
    yield state
    import subprocess

    docker = str(tmp_path / "bin" / "docker")
    for info in sorted(state.glob("*.json")):
        subprocess.run([docker, "rm", "--force", info.stem], capture_output=True)
