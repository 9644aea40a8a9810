"""A KV cache group states the least tokens per state of its layers.

A uniform-type group may hold attention layers that compress a different
number of tokens into one state (DeepSeek-V4.1's block-outermost group of
its ratio-2 and ratio-1 compressed caches), and the scheduler's copy of the
group keeps one layer's spec only. The group states the least
``tokens_per_state`` of its layers, so the scheduler side can tell that
none of them holds a state yet; the tests read it from the scheduler's
config as vLLM builds it.
"""

from __future__ import annotations

import torch
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)

BLOCK = 256


def _compressed(tokens_per_state: int) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.bfloat16,
        tokens_per_state=tokens_per_state,
    )


def _scheduler_group(specs: dict[str, KVCacheSpec]) -> KVCacheGroupSpec:
    """The scheduler's copy of the one group holding ``specs``."""
    spec = UniformTypeKVCacheSpecs.from_specs(specs) if len(specs) > 1 else None
    group = KVCacheGroupSpec(list(specs), spec or next(iter(specs.values())))
    worker = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])
    [scheduler_group] = generate_scheduler_kv_cache_config([worker]).kv_cache_groups
    return scheduler_group


def test_a_uniform_group_of_two_ratios_states_the_least() -> None:
    group = _scheduler_group(
        {
            "model.layers.0.attn": _compressed(2),
            "model.layers.0.attn.indexer.k_cache": _compressed(2),
            "model.layers.2.attn": _compressed(1),
            "model.layers.2.attn.indexer.k_cache": _compressed(1),
        }
    )
    # The scheduler keeps the first layer's spec, ratio 2.
    assert group.kv_cache_spec.tokens_per_state == 2
    assert group.min_tokens_per_state == 1


def test_a_group_of_one_ratio_states_it() -> None:
    group = _scheduler_group({"model.layers.3.self_attn.compressed": _compressed(16)})
    assert group.min_tokens_per_state == 16


def test_a_state_group_states_no_ratio() -> None:
    state = MambaSpec(
        block_size=BLOCK, shapes=((4, 4),), dtypes=(torch.float32,), page_size_padded=64
    )
    group = _scheduler_group({"model.layers.0.linear_attn": state})
    assert getattr(group, "min_tokens_per_state", None) is None
