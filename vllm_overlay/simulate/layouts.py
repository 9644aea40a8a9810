"""KV cache layouts, as per-layer vLLM spec objects.

Two sets: the mechanism layouts below (small, each reproducing one upstream
report: ``llama``, ``gemma``, ``dsv4``, ``kimi``, ``glm``) and the model
families of vLLM 0.33.0 (``families.py``), built the way each model's own code
builds its specs. The specs go through vLLM's real planner
(``legs.build_leg``); nothing here builds groups by hand.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm_overlay.simulate.families import (
    family_dcp_sizes,
    family_layouts,
    ring_group,
)
from vllm_overlay.simulate.layout_types import Layout, Ring, SpecSlots


def _bf16() -> Any:
    import torch

    return torch.bfloat16


def _full(block: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=block, num_kv_heads=1, head_size=128, dtype=_bf16()
    )


def _sw(block: int, window: int) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=block,
        num_kv_heads=1,
        head_size=128,
        dtype=_bf16(),
        sliding_window=window,
    )


def _mla(block: int, head_size: int = 576) -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(
        block_size=block, num_kv_heads=1, head_size=head_size, dtype=_bf16()
    )


def _kda(block: int, page_bytes: int, scratch: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=block,
        shapes=((4, 64), (2, 64, 64)),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=page_bytes,
        mamba_cache_mode="align",
        num_speculative_blocks=scratch,
    )


def _tail_ring(capacity: int, head_size: int) -> Any:
    """GLM-5.3-Flash's kpool tail: a ``CircularBufferSpec`` ring of the open
    kpool group's rows (``Glm5NextTailCache.get_kv_cache_spec``), never a
    prefix hit and empty at a block-aligned one."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    return CircularBufferSpec(
        block_size=capacity,
        num_kv_heads=1,
        head_size=head_size,
        head_size_v=0,
        dtype=_bf16(),
        dcp_sharded=False,
        **ring_group(_GLM_KPOOL),
    )


def _llama() -> dict[str, Any]:
    return {f"model.layers.{i}.self_attn.attn": _full(16) for i in range(2)}


def _gemma() -> dict[str, Any]:
    specs = {}
    for i in range(6):
        full = i % 6 == 5
        specs[f"model.layers.{i}.self_attn.attn"] = _full(16) if full else _sw(16, 512)
    return specs


def _dsv4() -> dict[str, Any]:
    specs = {}
    for i in range(4):
        specs[f"model.layers.{i}.attn.full"] = _full(64)
        specs[f"model.layers.{i}.attn.swa"] = _sw(64, 128)
    return specs


_KIMI_BLOCK = 64


def _kimi() -> dict[str, Any]:
    mla = _mla(_KIMI_BLOCK)
    specs: dict[str, Any] = {}
    for i in range(4):
        if i % 4 == 3:
            specs[f"model.layers.{i}.self_attn.attn"] = mla
        else:
            specs[f"model.layers.{i}.linear_attn.kda"] = _kda(
                _KIMI_BLOCK, mla.page_size_bytes, scratch=1
            )
    return specs


def _glm() -> dict[str, Any]:
    block = 64
    mla = _mla(block)
    tail = _tail_ring(_GLM_RING_CAPACITY, 576)
    kda = _kda(block, mla.page_size_bytes, scratch=1)
    # Three layers per kind, so the planner makes one group per kind:
    # G0 = MLA (target + MTP drafter), G1 = tail ring, G2 = KDA.
    specs: dict[str, Any] = {}
    for i in range(2):
        specs[f"model.layers.{2 * i}.linear_attn.kda"] = kda
        specs[f"model.layers.{2 * i + 1}.self_attn.attn"] = mla
        specs[f"model.layers.{2 * i + 1}.self_attn.kpool_tail"] = tail
    specs["model.layers.4.linear_attn.kda"] = kda
    specs["mtp.layers.0.self_attn.attn"] = mla
    specs["mtp.layers.0.self_attn.kpool_tail"] = tail
    return specs


# kpool 16 with one speculative token: 16 x pow2(cdiv(16 + 1, 16)) rows.
_GLM_KPOOL = 16
_GLM_RING_CAPACITY = 32
_KIMI_SLOTS = SpecSlots(num_speculative_tokens=1, num_lookahead_tokens=1)
_GLM_SLOTS = SpecSlots(num_speculative_tokens=1, num_lookahead_tokens=1)

BASE_LAYOUTS: dict[str, Layout] = {
    "llama": Layout("llama", 16, _llama, note="full attention, block 16"),
    "gemma": Layout("gemma", 16, _gemma, note="full + SW 512, block 16"),
    "dsv4": Layout(
        "dsv4",
        64,
        _dsv4,
        decode_slots=SpecSlots(num_lookahead_tokens=9),
        note="full + SW 128, block 64, decode lookahead 9, prefill none",
    ),
    "kimi": Layout(
        "kimi",
        _KIMI_BLOCK,
        _kimi,
        has_state=True,
        prefill_slots=_KIMI_SLOTS,
        decode_slots=_KIMI_SLOTS,
        note="MLA + KDA (1 scratch slot), DSpark-like slots",
    ),
    "glm": Layout(
        "glm",
        64,
        _glm,
        has_state=True,
        prefill_slots=_GLM_SLOTS,
        decode_slots=_GLM_SLOTS,
        ring=Ring(group_tokens=_GLM_KPOOL, capacity=_GLM_RING_CAPACITY),
        note="MLA+indexer, kpool tail ring (CircularBufferSpec), KDA, MTP-like slots",
    ),
}

_MECHANISM_DCP: dict[str, tuple[int, ...]] = {
    "llama": (1, 2, 4),
    # vLLM 0.33.0 asserts "DCP not support sliding window" at start, which
    # rules out DCP for every layout with a window (GLM's tail ring is one).
    "gemma": (1,),
    "dsv4": (1,),
    "kimi": (1, 2, 4),
    "glm": (1,),
}


def all_layouts() -> dict[str, Layout]:
    """Mechanism layouts, then one per model family and grouping layout."""
    return {**BASE_LAYOUTS, **family_layouts()}


def dcp_sizes() -> dict[str, tuple[int, ...]]:
    """DCP sizes each layout runs at by default."""
    return {**_MECHANISM_DCP, **family_dcp_sizes()}


def expand(names: list[str] | None = None) -> list[Layout]:
    """All layouts, one per allowed DCP size (``name`` or ``name/dcpN``)."""
    layouts = all_layouts()
    sizes_of = dcp_sizes()
    out: list[Layout] = []
    for base in names or list(layouts):
        key, _, dcp_part = base.partition("/dcp")
        if key not in layouts:
            raise KeyError(f"unknown layout {key!r}; known: {', '.join(layouts)}")
        layout = layouts[key]
        sizes = (int(dcp_part),) if dcp_part else sizes_of[key]
        for dcp in sizes:
            name = key if dcp == 1 else f"{key}/dcp{dcp}"
            out.append(replace(layout, name=name, dcp=dcp))
    return out
