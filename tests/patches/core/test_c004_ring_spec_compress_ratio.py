"""A circular-buffer KV cache spec states the compression ratio of the group
whose open rows it holds.

The ring's capacity (``block_size``) is the group size plus the speculative
lookahead, rounded, so it does not tell a KV connector which positions the
ring holds after ``n`` tokens. Each model layer that builds a ring states
its group size on the spec; the tests build the spec with the real layer's
``get_kv_cache_spec`` under the engine's config.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig, VllmConfig, set_current_vllm_config
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    UniformTypeKVCacheSpecs,
)

from tests.patches.builders import make_vllm_config

BLOCK_SIZE = 128


def _vllm_config(model_dir: Path, num_speculative_tokens: int) -> VllmConfig:
    # The ring's capacity grows with the speculative lookahead; its group
    # size does not.
    return make_vllm_config(
        model_dir,
        KVTransferConfig(kv_connector="MoRIIOConnector", kv_role="kv_both"),
        block_size=BLOCK_SIZE,
        speculative_config=(
            {"method": "ngram", "num_speculative_tokens": num_speculative_tokens}
            if num_speculative_tokens
            else None
        ),
    )


@pytest.fixture(params=[0, 1], ids=["no-spec", "spec-1"])
def num_speculative_tokens(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def _ring_spec(layer: Any, vllm_config: VllmConfig) -> CircularBufferSpec:
    spec = layer.get_kv_cache_spec(vllm_config)
    assert isinstance(spec, CircularBufferSpec)
    return spec


@pytest.fixture
def glm5next_layers(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``vllm.models.glm5next.common.attention`` without the package's
    ``__init__``, which imports the multimodal model (torchvision)."""
    package = "vllm.models.glm5next"
    if package not in sys.modules:
        spec = importlib.util.find_spec("vllm.models")
        assert spec is not None and spec.submodule_search_locations
        stub = types.ModuleType(package)
        stub.__path__ = [
            str(Path(p) / "glm5next") for p in spec.submodule_search_locations
        ]
        monkeypatch.setitem(sys.modules, package, stub)
    return importlib.import_module(f"{package}.common.attention")


@pytest.mark.parametrize("kpool", [4, 16])
def test_glm5next_tail_ring_states_its_kpool(
    glm5next_layers: types.ModuleType,
    llama_model_dir: Path,
    num_speculative_tokens: int,
    kpool: int,
) -> None:
    Glm5NextTailCache = glm5next_layers.Glm5NextTailCache

    vllm_config = _vllm_config(llama_model_dir, num_speculative_tokens)
    with set_current_vllm_config(vllm_config):
        layer = Glm5NextTailCache(
            head_dim=128,
            dtype=torch.bfloat16,
            prefix="model.layers.0.self_attn.indexer.tail_cache",
            cache_config=vllm_config.cache_config,
            index_kpool=kpool,
        )
        spec = _ring_spec(layer, vllm_config)
    assert spec.compress_ratio == kpool
    assert spec.block_size % kpool == 0


@pytest.mark.parametrize("compress_ratio", [2, 4])
def test_qwen4_exp_qsa_ring_states_its_compress_ratio(
    llama_model_dir: Path, num_speculative_tokens: int, compress_ratio: int
) -> None:
    from vllm.models.qwen4_exp.common.qsa_indexer import QSARawKeyCache

    vllm_config = _vllm_config(llama_model_dir, num_speculative_tokens)
    with set_current_vllm_config(vllm_config):
        layer = QSARawKeyCache(
            head_size=64,
            dtype=torch.bfloat16,
            cache_config=vllm_config.cache_config,
            prefix="model.layers.0.self_attn.qsa.raw_key_cache",
            vllm_config=vllm_config,
            compress_ratio=compress_ratio,
        )
        spec = _ring_spec(layer, vllm_config)
    assert spec.compress_ratio == compress_ratio


def test_deepseek_v41_compressor_ring_states_its_compress_ratio(
    llama_model_dir: Path, num_speculative_tokens: int
) -> None:
    from vllm.models.deepseek_v41.compressor import CompressorStateCache

    vllm_config = _vllm_config(llama_model_dir, num_speculative_tokens)
    with set_current_vllm_config(vllm_config):
        # As DeepseekCompressor builds its ring for compress_ratio 2.
        layer = CompressorStateCache(
            state_dim=2 * 512,
            dtype=torch.float32,
            prefix="model.layers.0.attn.compressor.state_cache",
            compress_ratio=2,
        )
        spec = _ring_spec(layer, vllm_config)
    assert spec.compress_ratio == 2
    # The capacity is set by the speculative lookahead alone.
    assert spec.block_size == 8


class _MainLayer:
    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=128,
            dtype=torch.bfloat16,
        )


def test_step5_csa_tail_ring_states_its_region(
    llama_model_dir: Path, num_speculative_tokens: int
) -> None:
    from vllm.models.step5.common.csa_tail_ring import Step5CSATailRing

    vllm_config = _vllm_config(llama_model_dir, num_speculative_tokens)
    context: dict[str, Any] = {"model.layers.0.attn": _MainLayer()}
    layer = Step5CSATailRing(
        prefix="model.layers.0.attn.csa_tail_ring",
        main_layer_name="model.layers.0.attn",
        num_speculative_tokens=num_speculative_tokens,
        static_forward_context=context,
    )
    spec = _ring_spec(layer, vllm_config)
    # A CSA region summarises eight rows.
    assert spec.compress_ratio == 8


def test_the_uniform_type_group_keeps_each_ring_ratio() -> None:
    def ring(ratio: int) -> CircularBufferSpec:
        return CircularBufferSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=64,
            dtype=torch.bfloat16,
            compress_ratio=ratio,
        )

    specs = {"layer.0.ring": ring(2), "layer.1.ring": ring(4)}
    group = KVCacheGroupSpec(
        list(specs),
        UniformTypeKVCacheSpecs.from_specs(specs),  # type: ignore[arg-type]
    )
    wrapped = group.kv_cache_spec
    assert isinstance(wrapped, UniformTypeKVCacheSpecs)
    assert {
        name: s.compress_ratio  # type: ignore[attr-defined]
        for name, s in wrapped.kv_cache_specs.items()
    } == {"layer.0.ring": 2, "layer.1.ring": 4}
    assert CircularBufferSpec.merge([ring(16), ring(16)]).compress_ratio == 16
