"""Shared pieces of the E2E harness tests: the sample config, a local model."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import msgspec
import pytest

from vllm_overlay.e2e.config import PairConfig, Reach, load_config

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "mi350x-pair.toml"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
LOOPBACK = "127.0.0.1"

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
def example_config() -> PairConfig:
    return load_config(EXAMPLE)


@pytest.fixture(scope="session")
def local_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama-tp8")
    (d / "config.json").write_text(json.dumps(LLAMA_TP8))
    return d


@pytest.fixture
def local_example(example_config: PairConfig, local_model: Path) -> PairConfig:
    """The sample pair with the model path pointing at the local config."""
    model = msgspec.structs.replace(example_config.model, path=str(local_model))
    return msgspec.structs.replace(example_config, model=model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def loopback_pair(config: PairConfig, health_s: float) -> PairConfig:
    """The sample pair moved onto 127.0.0.1 with free ports, the router as a
    local process."""
    router = msgspec.structs.replace(
        config.router,
        address=LOOPBACK,
        bind=LOOPBACK,
        port=free_port(),
        proxy_ping_port=free_port(),
        prometheus_port=free_port(),
        container=False,
        reach=Reach(),
    )
    legs = {
        leg: msgspec.structs.replace(
            getattr(config, leg), address=LOOPBACK, http_port=free_port(), reach=Reach()
        )
        for leg in ("prefill", "decode")
    }
    timeouts = msgspec.structs.replace(config.timeouts, health_s=health_s, poll_s=0.5)
    return msgspec.structs.replace(config, router=router, timeouts=timeouts, **legs)
