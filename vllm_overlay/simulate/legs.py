"""Build the prefill (kv_producer) and decode (kv_consumer) legs.

Each leg is a real vLLM ``Scheduler`` whose ``KVCacheConfig`` comes out of
vLLM's own planner, the way the engine core builds it, with the MoRIIO
connector in READ mode (no sockets, no threads).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_overlay.simulate.layout_types import Layout, SpecDecode, SpecSlots

# Folders holding only a config.json: the scheduler and the connector read
# the specs, the block sizes and the speculative config, not the model; the
# target only has to let vLLM resolve the speculative method offline.
_LLAMA_JSON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 65536,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
_MTP_TARGET_JSON: dict[str, Any] = {
    # A GQA target (an MLA one makes the CPU platform override the block size).
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 1,
    "vocab_size": 65536,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
_EAGLE3_JSON: dict[str, Any] = {
    **_LLAMA_JSON,
    "architectures": ["LlamaForCausalLMEagle3"],
    "num_hidden_layers": 1,
    "draft_vocab_size": 65536,
}


def _model_dir(
    name: str = "llama",
    config: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> str:
    """A folder holding only ``config.json``; one per distinct config, so
    processes building different models never share a file."""
    merged = {**(config or _LLAMA_JSON), **(overrides or {})}
    text = json.dumps(merged, sort_keys=True)
    if overrides:
        name += "-" + hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"vllm-overlay-sim-{name}"
    path.mkdir(exist_ok=True)
    cfg = path / "config.json"
    if not cfg.exists() or cfg.read_text() != text:
        # Ranks, test workers and other checkouts share this folder: each
        # writer renames its own file, so a reader never sees half a file.
        tmp = path / f".config.json.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, cfg)
    return str(path)


def _target_dir(spec: SpecDecode | None, overrides: dict[str, Any]) -> str:
    if spec is not None and spec.method == "mtp":
        return _model_dir("mtp-target", _MTP_TARGET_JSON, overrides)
    return _model_dir(overrides=overrides)


def _speculative_config(spec: SpecDecode | None, model_config: Any) -> Any:
    if spec is None:
        return None
    from vllm.config import ParallelConfig, SpeculativeConfig

    extra: dict[str, Any] = {}
    if spec.method == "eagle3":
        extra["model"] = _model_dir("eagle3-draft", _EAGLE3_JSON)
    return SpeculativeConfig(
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
        method=spec.method,
        num_speculative_tokens=spec.num_speculative_tokens,
        **extra,
    )


def primary_block_size(specs: dict[str, Any]) -> int:
    """The ``--block-size`` of a layout: its first full-attention layer's."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    size: int = next(
        (s.block_size for s in specs.values() if isinstance(s, FullAttentionSpec)),
        next(iter(specs.values())).block_size,
    )
    return size


def _with_spec_slots(vllm_config: Any, slots: SpecSlots) -> Any:
    """Give one leg the slot counts a speculative config would give it.

    Scheduler, KV cache manager and connector read these two ``VllmConfig``
    properties; the drafter itself is not modelled.
    """
    if slots.num_speculative_tokens == 0 and slots.num_lookahead_tokens == 0:
        return vllm_config
    base = type(vllm_config)
    sub = type(
        f"{base.__name__}WithSpecSlots",
        (base,),
        {
            "num_speculative_tokens": property(
                lambda self: slots.num_speculative_tokens
            ),
            "num_lookahead_tokens": property(lambda self: slots.num_lookahead_tokens),
        },
    )
    vllm_config.__class__ = sub
    return vllm_config


@dataclass(frozen=True)
class LegOptions:
    """What the byte-level simulator changes; the defaults are the scheduler
    simulator's legs."""

    read_mode: bool = True
    tensor_parallel_size: int | None = None
    """Default: the layout's DCP size."""
    kv_cache_layout: str | None = None
    """Default: the layout's."""
    model_json: dict[str, Any] = field(default_factory=dict)
    """Merged over the target's ``config.json``."""
    specs: Callable[[], dict[str, Any]] | None = None
    """Per-layer specs of this leg's ranks; default: the layout's."""
    extra_config: dict[str, Any] = field(default_factory=dict)
    """Merged over ``kv_connector_extra_config``."""
    with_scheduler: bool = True
    pool_requests: int = 4
    """Max-length requests the block pool holds (plus one block)."""


@dataclass
class Leg:
    """One leg: its scheduler, config and the resolved block geometry."""

    role: str
    vllm_config: Any
    scheduler: Any
    kv_cache_config: Any
    block_hasher: Any
    group_block_tokens: list[int]
    """Positions one block holds per KV cache group (block size x DCP)."""
    group_page_bytes: list[int]
    """Bytes of one page per group, summed over the group's layers."""
    worker_config: Any = None
    """The workers' ``KVCacheConfig`` (the scheduler's replaces each
    ``UniformTypeKVCacheSpecs`` by its first layer spec)."""


def leg_config(
    layout: Layout,
    role: str,
    port: int,
    max_model_len: int,
    options: LegOptions | None = None,
) -> tuple[Any, dict[str, Any]]:
    """One leg's ``VllmConfig`` (MoRIIO READ unless ``options`` say WRITE)
    and the layer specs."""
    import torch  # noqa: F401  (vLLM expects torch imported first)
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.config.attention import HiSparseConfig
    from vllm.v1.kv_cache_interface import MambaSpec, iter_layer_specs

    opts = options or LegOptions()
    dcp = layout.dcp
    layout.register_specs()
    specs = opts.specs() if opts.specs is not None else layout.layer_specs()
    has_state = layout.has_state or any(
        isinstance(s, MambaSpec)
        for spec in specs.values()
        for s in iter_layer_specs(spec)
    )
    block_size = layout.block_size or primary_block_size(specs)
    extra = {
        "handshake_port": port,
        "notify_port": port + 1,
        "proxy_ip": "127.0.0.1",
        "http_port": port + 2,
        "read_mode": opts.read_mode,
        "host_ip": "127.0.0.1",
        **opts.extra_config,
    }
    model_config = ModelConfig(
        model=_target_dir(layout.speculative, opts.model_json),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    attention_config = AttentionConfig()
    if layout.hisparse:
        attention_config.hisparse_config = HiSparseConfig()
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=layout.prefix_caching,
            mamba_cache_mode="align" if has_state else "none",
        ),
        speculative_config=_speculative_config(layout.speculative, model_config),
        attention_config=attention_config,
        parallel_config=ParallelConfig(
            tensor_parallel_size=opts.tensor_parallel_size or dcp,
            decode_context_parallel_size=dcp,
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_model_len,
            max_num_seqs=8,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MoRIIOConnector",
            kv_role=role,
            kv_connector_extra_config=extra,
            # A failed receive (WRITE's write_failed) is recomputed by the
            # decoder, not failed: the request is judged after that.
            kv_load_failure_policy="recompute",
        ),
    )
    slots = layout.decode_slots if role == "kv_consumer" else layout.prefill_slots
    vllm_config = _with_spec_slots(vllm_config, slots)
    vllm_config.cache_config.kv_cache_layout = (
        opts.kv_cache_layout or layout.kv_cache_layout
    )
    return vllm_config, specs


def plan_groups(layout: Layout, max_model_len: int = 4160) -> list[Any]:
    """vLLM's global KV cache groups of the layout (the workers' view)."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    vllm_config, specs = leg_config(layout, "kv_consumer", 49000, max_model_len)
    register_all_kvcache_specs(vllm_config)
    groups: list[Any] = get_global_kv_cache_groups(vllm_config, [specs])
    return groups


def _allocation_bytes(kv_cache_config: Any) -> int:
    """Bytes of the device allocation backing ``kv_cache_config``.

    Every device ``KVCacheTensor`` places its layers in one backing
    allocation and carries that allocation's size, so summing the tensors
    counts it once per tensor (nine times over for a block-outermost
    DeepSeek-V4.1). Host-resident tensors (HiSparse) have their own pool.
    """
    device = [t.size for t in kv_cache_config.kv_cache_tensors if not t.host_resident]
    return max(device, default=0)


class RingLayerError(RuntimeError):
    """A ring layer object vLLM builds does not state the layout's spec."""


def build_ring_layers(layout: Layout, vllm_config: Any, specs: dict[str, Any]) -> int:
    """The ring layer objects a worker's model registers at load, where the
    layout's ring is one vLLM builds as a layer stating its group size
    (``Ring.qsa_raw_key``: Qwen4 exp's ``QSARawKeyCache``): one per ring
    layer of ``specs``, built as the model's QSA indexer builds it
    (models/qwen4_exp/{amd,nvidia}/qsa_indexer.py), each registering itself
    in ``vllm_config``'s static forward context, where the worker's connector
    may read it. Its own ``get_kv_cache_spec`` must be the layout's spec
    (the drafter's marked as ``GPUModelRunner`` marks it), or
    ``RingLayerError``. Returns how many it built."""
    from dataclasses import replace

    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    qsa = layout.ring.qsa_raw_key if layout.ring is not None else None
    if qsa is None:
        return 0
    import torch
    from vllm.models.qwen4_exp.common.qsa_indexer import QSARawKeyCache

    built = 0
    for name, spec in specs.items():
        if not isinstance(spec, CircularBufferSpec):
            continue
        with set_current_vllm_config(vllm_config):
            layer = QSARawKeyCache(
                head_size=qsa.head_size,
                dtype=torch.bfloat16,
                cache_rope_positions=vllm_config.model_config.uses_mrope,
                prefix=name,
                cache_config=vllm_config.cache_config,
                compress_ratio=qsa.compress_ratio,
                vllm_config=vllm_config,
            )
            own = layer.get_kv_cache_spec(vllm_config)
        if spec.is_draft:
            own = replace(own, is_draft=True)
        if own != spec:
            raise RingLayerError(
                f"{layout.name}: {name}: vLLM's QSARawKeyCache states {own}, "
                f"the layout {spec}"
            )
        built += 1
    return built


def build_leg(
    layout: Layout,
    role: str,
    port: int,
    max_model_len: int,
    options: LegOptions | None = None,
) -> Leg:
    """Build one leg; raises whatever vLLM or the connector raise at start."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_dcp_kv_block_size,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.structured_output import StructuredOutputManager

    dcp = layout.dcp
    vllm_config, specs = leg_config(layout, role, port, max_model_len, options)
    # The model loads before the KV caches are planned.
    build_ring_layers(layout, vllm_config, specs)
    register_all_kvcache_specs(vllm_config)
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
    # Size the pool through the planner: bytes for a few max-length requests.
    probe = get_kv_cache_configs(vllm_config, [specs], [1 << 40], groups)[0]
    bytes_per_block = _allocation_bytes(probe) // probe.num_blocks
    # A group's table row is at most one block per block_size positions; a
    # ring (CircularBufferSpec) holds one block per request.
    blocks_per_req = sum(
        min(
            -(-max_model_len // resolve_dcp_kv_block_size(g.kv_cache_spec, dcp)),
            g.kv_cache_spec.max_num_blocks_per_req(vllm_config, max_model_len),
        )
        + 4
        for g in probe.kv_cache_groups
    )
    pool_requests = (options or LegOptions()).pool_requests
    memory = bytes_per_block * (blocks_per_req * pool_requests + 1)
    configs = get_kv_cache_configs(vllm_config, [specs], [memory], groups)
    for cfg in configs:
        cfg.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    sched_cfg = generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = sched_cfg.num_blocks
    participating = [
        g.kv_cache_spec.block_size
        for g in sched_cfg.kv_cache_groups
        if g.kv_cache_spec.prefix_cacheable
    ]
    vllm_config.cache_config.block_size = min(
        participating or [g.kv_cache_spec.block_size for g in sched_cfg.kv_cache_groups]
    )
    vllm_config.validate_block_size()
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(sched_cfg, vllm_config)
    align = resolve_cache_hit_alignment_tokens(
        sched_cfg, vllm_config, sched_bs, hash_bs
    )
    for cfg in (*configs, sched_cfg):
        cfg.hash_block_size = hash_bs
        cfg.cache_hit_alignment_tokens = align

    scheduler = None
    if options is None or options.with_scheduler:
        with set_current_vllm_config(vllm_config):
            scheduler = Scheduler(
                vllm_config=vllm_config,
                kv_cache_config=sched_cfg,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=sched_bs,
                hash_block_size=hash_bs,
            )
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(
        hash_bs, hash_fn, vllm_config.num_hash_lookahead_tokens
    )

    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    page_bytes = [
        group.kv_cache_spec.page_size_bytes
        * (
            1
            if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
            else len(group.layer_names)
        )
        for group in configs[0].kv_cache_groups
    ]
    return Leg(
        role=role,
        vllm_config=vllm_config,
        scheduler=scheduler,
        kv_cache_config=sched_cfg,
        block_hasher=hasher,
        group_block_tokens=[
            resolve_dcp_kv_block_size(g.kv_cache_spec, dcp)
            for g in sched_cfg.kv_cache_groups
        ],
        group_page_bytes=page_bytes,
        worker_config=configs[0],
    )
