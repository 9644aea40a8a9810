"""The per-rank KV cache specs of a layout under tensor parallelism.

The scheduler simulator's layouts (``simulate/layouts.py``) fix the group
structure: block sizes, windows, group kinds and speculative slots. A worker
also needs what TP changes: GQA layers hold ``kv_heads / tp`` heads (one
replicated head past ``kv_heads`` ranks), MLA latents are replicated, and a
KDA layer holds ``1 / tp`` of its conv and recurrent state, shaped the way
vLLM's model code shapes it (``MambaStateShapeCalculator.kda_state_shape``,
``GDN_ATTN``); a Mamba state of another shape (Qwen4-exp's one-array PLE
state) or a TP-replicated one (ZAYA's CCA history) is kept as the family
declares it, so the connector judges it as it
would in production. A model family keeps its own head geometry (only TP
splits its heads), unless its code builds more per rank (Step5's ring of
its rank's page, LFM3's sharded conv state, ZAYA's state padded to its
rank's page): then its own per-rank specs
(``Layout.build_rank_specs``).
Nothing else of a layout changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vllm_overlay.simulate.layout_types import Layout


@dataclass(frozen=True)
class Geometry:
    """Model dimensions; small, so a case moves little memory."""

    kv_heads: int = 4
    """KV heads of every GQA (full or sliding-window) layer, before TP."""
    head_size: int = 32
    kda_heads: int = 4
    """Split over up to 4 TP ranks (DCP 4 runs TP 4)."""
    kda_head_dim: int = 32
    conv_kernel: int = 4


def is_mla(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    return isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec))


def local_heads(tp_size: int, total: int) -> int:
    return total // tp_size if tp_size <= total else 1


def uses_mla(layout: Layout) -> bool:
    """Whether the layout's model is an MLA model (vLLM's ``use_mla``): its
    attention keeps latents. A sparse indexer's key cache is an MLA spec in
    vLLM on models of either kind (MiniMax-M3's sits beside GQA heads), so
    it does not count."""
    from vllm.v1.kv_cache_interface import SparseCacheRole

    return any(
        is_mla(spec) and getattr(spec, "cache_role", None) != SparseCacheRole.INDEXER
        for spec in layout.layer_specs().values()
    )


def model_json(layout: Layout, geometry: Geometry) -> dict[str, Any]:
    """``config.json`` overrides: the total KV heads the connector reads from
    the model config, and a DeepSeek-style MLA model when the layout's model
    is one (``uses_mla``; the worker's ``use_mla``)."""
    if uses_mla(layout):
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "first_k_dense_replace": 2,
        }
    heads, head_size = geometry.kv_heads, geometry.head_size
    if layout.family:
        gqa = next(s for s in layout.layer_specs().values() if _is_gqa(s))
        heads, head_size = gqa.num_kv_heads, gqa.head_size
    # Query heads split over up to 4 TP ranks (DCP 4 runs TP 4), and the
    # hidden size over the query heads, as vLLM checks.
    query_heads = max(2 * heads, 4)
    return {
        "num_attention_heads": query_heads,
        "num_key_value_heads": heads,
        "head_dim": head_size,
        "hidden_size": query_heads * head_size,
    }


def _is_gqa(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import AttentionSpec

    return isinstance(spec, AttentionSpec) and not is_mla(spec)


def _is_ring(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    return isinstance(spec, CircularBufferSpec)


def _takes_geometry(layout: Layout, spec: Any) -> bool:
    """Whether a mechanism layout's layer takes ``Geometry``'s GQA heads: a
    ring keeps its own spec, TP-replicated like the MLA latents beside it
    (GLM-5's kpool tail ring: one head of the indexer's key on every
    rank)."""
    return not layout.family and _is_gqa(spec) and not _is_ring(spec)


def layer_total_heads(layout: Layout, geometry: Geometry) -> dict[str, int | None]:
    """Global KV heads of each GQA layer (None: replicated on every rank).
    A model family keeps its own head geometry (its page sizes are what the
    planner unifies); a mechanism layout takes ``geometry``'s, but for its
    ring (``_takes_geometry``)."""
    return {
        name: spec.num_kv_heads
        if layout.family and _is_gqa(spec)
        else geometry.kv_heads
        if _takes_geometry(layout, spec)
        else None
        for name, spec in layout.layer_specs().items()
    }


def rank_specs(
    layout: Layout, tp_size: int, geometry: Geometry, num_speculative_tokens: int
) -> dict[str, Any]:
    """Per-layer specs of one rank of a leg with ``tp_size`` ranks."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    if layout.build_rank_specs is not None:
        # The model's own per-rank specs: heads, state and block already
        # this rank's.
        return layout.build_rank_specs(tp_size)
    out: dict[str, Any] = {}
    mamba: dict[str, Any] = {}
    for name, spec in layout.layer_specs().items():
        if (
            isinstance(spec, MambaSpec)
            and len(spec.shapes) == 2
            and not spec.tp_replicated
        ):
            mamba[name] = spec
        elif _is_gqa(spec) and layout.family:
            out[name] = replace(
                spec, num_kv_heads=local_heads(tp_size, spec.num_kv_heads)
            )
        elif _takes_geometry(layout, spec):
            out[name] = replace(
                spec,
                num_kv_heads=local_heads(tp_size, geometry.kv_heads),
                head_size=geometry.head_size,
                head_size_v=geometry.head_size,
            )
        else:
            out[name] = spec
    if mamba:
        page = max(spec.page_size_bytes for spec in out.values())
        shapes = MambaStateShapeCalculator.kda_state_shape(
            tp_size,
            geometry.kda_heads,
            geometry.kda_head_dim,
            conv_kernel_size=geometry.conv_kernel,
            num_spec=num_speculative_tokens,
        )
        for name, spec in mamba.items():
            kda = MambaSpec(
                block_size=spec.block_size,
                shapes=shapes,
                dtypes=(torch.bfloat16, torch.float32),
                page_size_padded=page,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                mamba_cache_mode=spec.mamba_cache_mode,
                num_speculative_blocks=spec.num_speculative_blocks,
            )
            if kda.real_page_size_bytes > page:
                raise ValueError(
                    f"{layout.name}: KDA state ({kda.real_page_size_bytes} B) "
                    f"exceeds the attention page ({page} B)"
                )
            out[name] = kda
    return {name: out[name] for name in layout.layer_specs()}
