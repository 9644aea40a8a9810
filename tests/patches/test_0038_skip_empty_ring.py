"""READ and WRITE skip a ring whose open compression group is empty.

A ring (``CircularBufferSpec``) holds the raw rows of the compression group
its model is still compressing. The decoder computes the last prompt token
N - 1 itself and reads the ring's rows of positions (N - 1) // g * g to
N - 1, g the group size: none when N - 1 is a multiple of g. Where vLLM's
spec states g (``CircularBufferSpec.compress_ratio``), neither mode moves
such a ring page; a spec that does not state it moves the ring as before.
The specs here state g as vLLM's do where the spec has the field.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import CircularBufferSpec, KVCacheSpec

from tests.patches.builders import (
    build_write_pair,
    full_attention_spec,
    kda_mamba_spec,
    make_kv_cache_config,
    prompt,
)
from tests.patches.test_0009_rings_and_wrapped_state import (
    KPOOL,
    Grouping,
    _configs,
    _transfer,
    glm5_next_layer_specs,
    real_grouping,
)

B = 16
ATTN = "model.layers.1.self_attn.attn"
STATE = "model.layers.0.linear_attn"
RING = "model.layers.1.self_attn.tail_cache"


@pytest.fixture(params=[0, 1], ids=["no-spec", "mtp"])
def num_spec(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def configs(
    llama_model_dir: Path, deepseek_mtp_model_dir: Path, num_spec: int
) -> tuple[Any, Any]:
    return _configs(deepseek_mtp_model_dir if num_spec else llama_model_dir, num_spec)


def stating_group_size(spec: CircularBufferSpec, group_size: int) -> Any:
    """``spec`` stating the size of the group whose rows it holds."""
    if "compress_ratio" in {f.name for f in fields(CircularBufferSpec)}:
        return replace(spec, compress_ratio=group_size)  # type: ignore[call-arg]
    stated = replace(spec)
    object.__setattr__(stated, "compress_ratio", group_size)
    return stated


def ring_spec(group_size: int | None = KPOOL) -> CircularBufferSpec:
    spec = CircularBufferSpec(
        block_size=KPOOL,
        num_kv_heads=2,
        head_size=64,
        head_size_v=0,
        dtype=torch.bfloat16,
    )
    return spec if group_size is None else stating_group_size(spec, group_size)


def stated_grouping(vllm_config: Any, num_spec: int) -> Grouping:
    """GLM-5.3-Flash's real grouping, its kpool tail rings stating kpool."""
    specs: dict[str, KVCacheSpec] = {
        name: stating_group_size(spec, KPOOL)
        if isinstance(spec, CircularBufferSpec)
        else spec
        for name, spec in glm5_next_layer_specs(num_spec).items()
    }
    previous = vllm_config.cache_config.kv_cache_layout
    vllm_config.cache_config.kv_cache_layout = "BLNHC"
    try:
        groups = get_kv_cache_groups(vllm_config, specs)
    finally:
        vllm_config.cache_config.kv_cache_layout = previous
    worker = make_kv_cache_config(groups, num_blocks=2048)
    return Grouping(worker, generate_scheduler_kv_cache_config([worker]))


def _ring_pages(
    configs: Any, grouping: Grouping, num_spec: int, n: int
) -> tuple[list[int], list[int]]:
    """The decoder's and the prefiller's ring pages READ pairs for N = n."""
    kinds = grouping.kinds()
    req, _, _ = _transfer(configs, grouping, num_spec, n, 0)
    # Payload order: the attention groups in group order, then the states.
    attention = [g for g, kind in enumerate(kinds) if kind != "kda"]
    slot = attention.index(kinds.index("ring"))
    return req.local_block_ids[slot], req.remote_block_ids[slot]


# N - 1 a multiple of the kpool: the open group is empty.
@pytest.mark.parametrize("n", [17, 641, 1297])
def test_read_skips_a_ring_whose_open_group_is_empty(configs, num_spec, n) -> None:
    grouping = stated_grouping(configs[0], num_spec)
    assert _ring_pages(configs, grouping, num_spec, n) == ([], [])


@pytest.mark.parametrize("n", [2, 18, 640, 1300])
def test_read_reads_a_ring_whose_open_group_holds_rows(configs, num_spec, n) -> None:
    grouping = stated_grouping(configs[0], num_spec)
    local, remote = _ring_pages(configs, grouping, num_spec, n)
    assert len(local) == len(remote) == 1


def _written_ring(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, ring: CircularBufferSpec
) -> Any:
    groups: list[tuple[list[str], KVCacheSpec]] = [
        ([ATTN], full_attention_spec(B)),
        ([STATE], kda_mamba_spec(B)),
        ([RING], ring),
    ]
    pair = build_write_pair(model_dir, groups, B, monkeypatch)

    def ring_pairs(n: int, hit: int) -> list[tuple[int, int]]:
        write = pair.write(prompt(n, n), decode_hit_tokens=hit)
        assert write.notices == []
        return list(write.pairs_by_layer.get(RING, []))

    return ring_pairs


@pytest.mark.parametrize(("n", "hit"), [(17, 0), (129, 0), (129, 64)])
def test_write_skips_a_ring_whose_open_group_is_empty(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch, n: int, hit: int
) -> None:
    ring_pairs = _written_ring(llama_model_dir, monkeypatch, ring_spec())
    assert ring_pairs(n, hit) == []


@pytest.mark.parametrize(("n", "hit"), [(18, 0), (100, 0), (100, 48)])
def test_write_writes_a_ring_whose_open_group_holds_rows(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch, n: int, hit: int
) -> None:
    ring_pairs = _written_ring(llama_model_dir, monkeypatch, ring_spec())
    [(prefill_page, decode_page)] = ring_pairs(n, hit)
    assert 0 not in (prefill_page, decode_page)


def test_a_ring_not_stating_its_group_size_moves_as_before(
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    configs: tuple[Any, Any],
    num_spec: int,
) -> None:
    ring_pairs = _written_ring(llama_model_dir, monkeypatch, ring_spec(None))
    grouping = real_grouping(configs[0], num_spec)
    for n in (17, 129):
        assert len(ring_pairs(n, 0)) == 1
        local, remote = _ring_pages(configs, grouping, num_spec, n)
        assert len(local) == len(remote) == 1
