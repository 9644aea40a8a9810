"""READ and WRITE skip a group none of whose layers holds a state yet.

A compressed cache stores one state per ``tokens_per_state`` tokens (Qwen4
exp's compressed QSA keys: 16). The decoder computes the last prompt token
N - 1 itself and reads the states of positions before it: none while
N - 1 is less than every layer's ratio. Where vLLM's group states the least
ratio of its layers (``KVCacheGroupSpec.min_tokens_per_state``), neither
mode moves such a group's page; a group whose layers differ in ratio
(DeepSeek-V4.1's block-outermost group of ratio-2 and ratio-1 caches, whose
scheduler-side spec states 2) moves its page while one of them holds a
state, and a group that does not state it moves as before. The groups here
state the least ratio as vLLM's do where the group has the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)

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

RATIO = 16
ATTN = "model.layers.3.self_attn.attn"
COMPRESSED = "model.layers.3.self_attn.compressed_key_cache"
STATE = "model.layers.0.linear_attn"


def _stating(group: KVCacheGroupSpec, stated: bool = True) -> KVCacheGroupSpec:
    """``group`` stating the least ratio of its layers (or not at all)."""
    if not stated:
        if hasattr(group, "min_tokens_per_state"):
            group.min_tokens_per_state = None  # type: ignore[attr-defined]
        return group
    if getattr(group, "min_tokens_per_state", None) is None:
        least = min(s.tokens_per_state for s in iter_layer_specs(group.kv_cache_spec))
        group.min_tokens_per_state = least  # type: ignore[attr-defined]
    return group


def _compressed_specs(*ratios: int) -> KVCacheSpec:
    """One compressed cache per ratio, in one group."""
    specs: dict[str, KVCacheSpec] = {
        f"{COMPRESSED}.{i}": full_attention_spec(B, tokens_per_state=r)
        for i, r in enumerate(ratios)
    }
    if len(specs) == 1:
        return next(iter(specs.values()))
    wrapped = UniformTypeKVCacheSpecs.from_specs(specs)
    assert wrapped is not None
    return wrapped


def _scheduler_config(ratios: tuple[int, ...], stated: bool) -> KVCacheConfig:
    """The scheduler's copy of an attention, a compressed and a state group."""
    compressed = _compressed_specs(*ratios)
    names = (
        list(compressed.kv_cache_specs)
        if isinstance(compressed, UniformTypeKVCacheSpecs)
        else [COMPRESSED]
    )
    worker = make_kv_cache_config(
        [
            ([ATTN], full_attention_spec(B)),
            (names, compressed),
            ([STATE], kda_mamba_spec(B)),
        ]
    )
    for group in worker.kv_cache_groups:
        _stating(group, stated)
    return generate_scheduler_kv_cache_config([worker])


def _read_pages(
    llama_model_dir: Path, n: int, ratios: tuple[int, ...] = (RATIO,), stated=True
) -> list[int]:
    """The decoder's compressed-group pages READ fills for N = n."""
    config = _scheduler_config(ratios, stated)
    p_conn, d_conn = connector_pair(_configs(llama_model_dir, 0), config)
    t = run_transfer(p_conn, d_conn, config.kv_cache_groups, n, 0)
    # Payload order: the attention groups in group order, then the state.
    return t.local[1]


def _written(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    ratios: tuple[int, ...] = (RATIO,),
    stated: bool = True,
) -> Any:
    compressed = _compressed_specs(*ratios)
    pair = build_write_pair(
        model_dir,
        [
            ([ATTN], full_attention_spec(B)),
            ([COMPRESSED], compressed),
            ([STATE], kda_mamba_spec(B)),
        ],
        B,
        monkeypatch,
    )
    for leg in (pair.legs.prefill, pair.legs.decode):
        for group in leg.kv_cache_config.kv_cache_groups:
            _stating(group, stated)

    def compressed_pairs(n: int) -> list[tuple[int, int]]:
        write = pair.write(prompt(n, n))
        assert write.notices == []
        return list(write.pairs_by_layer.get(COMPRESSED, []))

    return compressed_pairs


# N - 1 below the ratio: no layer holds a compressed state.
@pytest.mark.parametrize("n", [2, RATIO])
def test_read_skips_a_group_holding_no_state(llama_model_dir: Path, n: int) -> None:
    assert _read_pages(llama_model_dir, n) == []


@pytest.mark.parametrize("n", [RATIO + 1, 129])
def test_read_reads_a_group_holding_a_state(llama_model_dir: Path, n: int) -> None:
    assert len(_read_pages(llama_model_dir, n)) == -(-(n - 1) // B)


@pytest.mark.parametrize("n", [2, RATIO])
def test_write_skips_a_group_holding_no_state(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    assert _written(llama_model_dir, monkeypatch)(n) == []


@pytest.mark.parametrize("n", [RATIO + 1, 129])
def test_write_writes_a_group_holding_a_state(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    pairs = _written(llama_model_dir, monkeypatch)(n)
    assert len(pairs) == -(-(n - 1) // B)


def test_a_group_of_mixed_ratios_moves_while_one_holds_a_state(
    llama_model_dir: Path,
) -> None:
    # The scheduler's spec is the ratio-2 layer's; the ratio-1 layer holds
    # the state of token 0.
    config = _scheduler_config((2, 1), stated=True)
    assert config.kv_cache_groups[1].kv_cache_spec.tokens_per_state == 2
    assert len(_read_pages(llama_model_dir, 2, (2, 1))) == 1


def test_a_group_not_stating_its_least_ratio_moves_as_before(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert len(_read_pages(llama_model_dir, 2, stated=False)) == 1
    assert len(_written(llama_model_dir, monkeypatch, stated=False)(2)) == 1
