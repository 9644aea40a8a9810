"""Shared builders for the per-patch tests, against the real vLLM classes.

Everything here builds offline on CPU: a ``VllmConfig`` from a local folder
that holds only ``config.json``, a MoRIIO ``KVTransferConfig``, a
``KVCacheConfig`` from spec objects, the real scheduler-side
``MoRIIOConnector`` and the ``Request`` / ``KVCacheBlocks`` /
``SchedulerOutput`` objects its hooks take.

Append-only: other patches' tests import from here (`conftest.py` beside
it holds only the fixtures). Re-read before editing.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector import (  # noqa: E402
    MoRIIOConnector,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

# --------------------------------------------------------------------------
# Model folders (config.json only)
# --------------------------------------------------------------------------

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}

# DeepSeek-V3-like MLA model with one MTP layer, enough for
# SpeculativeConfig(method="mtp") to resolve offline.
TINY_DEEPSEEK_MTP_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "num_nextn_predict_layers": 1,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def write_model_dir(directory: Path, config: Mapping[str, Any]) -> Path:
    """Write ``config.json`` into ``directory`` and return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(config)))
    return directory


# --------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------

_port_counter = itertools.count()


def moriio_kv_transfer_config(
    kv_role: str = "kv_consumer",
    *,
    read_mode: bool = True,
    port_base: int | None = None,
    **extra: Any,
) -> KVTransferConfig:
    """A MoRIIO ``KVTransferConfig``; READ mode unless ``read_mode=False``.

    Each call gets its own handshake/notify ports so two legs built in one
    process never share them. ``host_ip`` is pinned to loopback so building
    the scheduler never probes an outside address.
    """
    base = port_base if port_base is not None else 20000 + 10 * next(_port_counter)
    extra_config: dict[str, Any] = {
        "handshake_port": base,
        "notify_port": base + 1,
        "proxy_ip": "127.0.0.1",
        "http_port": base + 2,
        "host_ip": "127.0.0.1",
        "read_mode": read_mode,
    }
    extra_config.update(extra)
    return KVTransferConfig(
        kv_connector="MoRIIOConnector",
        kv_role=kv_role,
        kv_connector_extra_config=extra_config,
    )


def make_vllm_config(
    model_dir: Path,
    kv_transfer_config: KVTransferConfig,
    *,
    block_size: int = 16,
    speculative_config: Mapping[str, Any] | None = None,
    disable_hybrid_kv_cache_manager: bool = False,
    enable_prefix_caching: bool = True,
) -> VllmConfig:
    """A ``VllmConfig`` built offline from a folder holding only config.json.

    ``speculative_config`` is a dict such as ``{"method": "mtp",
    "num_speculative_tokens": 1}``; it is resolved into a real
    ``SpeculativeConfig`` against the target model.
    """
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True)
    cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=enable_prefix_caching
    )
    scheduler_config = SchedulerConfig.default_factory(
        max_model_len=model_config.max_model_len,
        is_encoder_decoder=model_config.is_encoder_decoder,
    )
    scheduler_config.disable_hybrid_kv_cache_manager = disable_hybrid_kv_cache_manager
    spec = None
    if speculative_config is not None:
        spec = SpeculativeConfig(
            target_model_config=model_config,
            target_parallel_config=VllmConfig().parallel_config,
            **dict(speculative_config),
        )
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        kv_transfer_config=kv_transfer_config,
        speculative_config=spec,
    )


# --------------------------------------------------------------------------
# KV cache specs and configs
# --------------------------------------------------------------------------


def full_attention_spec(block_size: int = 16, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=kw.pop("num_kv_heads", 2),
        head_size=kw.pop("head_size", 64),
        dtype=kw.pop("dtype", torch.bfloat16),
        **kw,
    )


def mla_spec(block_size: int = 64, **kw: Any) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=kw.pop("head_size", 576),
        dtype=kw.pop("dtype", torch.bfloat16),
        **kw,
    )


def sliding_window_spec(
    block_size: int = 16, sliding_window: int = 128, **kw: Any
) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=kw.pop("num_kv_heads", 2),
        head_size=kw.pop("head_size", 64),
        dtype=kw.pop("dtype", torch.bfloat16),
        sliding_window=sliding_window,
        **kw,
    )


def kda_mamba_spec(
    block_size: int = 64,
    num_speculative_blocks: int = 0,
    mamba_cache_mode: str = "align",
    **kw: Any,
) -> MambaSpec:
    """A KDA-like ``MambaSpec``: two states (conv, ssm)."""
    return MambaSpec(
        block_size=block_size,
        shapes=kw.pop("shapes", ((3, 512), (4, 64, 64))),
        dtypes=kw.pop("dtypes", (torch.bfloat16, torch.float32)),
        mamba_cache_mode=mamba_cache_mode,
        num_speculative_blocks=num_speculative_blocks,
        **kw,
    )


GroupLike = KVCacheGroupSpec | tuple[Sequence[str], KVCacheSpec]


def make_kv_cache_config(
    groups: Sequence[GroupLike], num_blocks: int = 4096
) -> KVCacheConfig:
    """A ``KVCacheConfig`` with the given groups and no tensors.

    ``groups`` holds ``KVCacheGroupSpec`` objects or ``(layer_names, spec)``
    pairs. The scheduler side never reads ``kv_cache_tensors``.
    """
    kv_cache_groups = [
        g if isinstance(g, KVCacheGroupSpec) else KVCacheGroupSpec(list(g[0]), g[1])
        for g in groups
    ]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups
    )


# --------------------------------------------------------------------------
# The real scheduler-side connector
# --------------------------------------------------------------------------


def make_scheduler_connector(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> MoRIIOConnector:
    """The real ``MoRIIOConnector`` in the SCHEDULER role."""
    with set_current_vllm_config(vllm_config):
        return MoRIIOConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


# --------------------------------------------------------------------------
# Requests, blocks, scheduler outputs
# --------------------------------------------------------------------------


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    *,
    status: RequestStatus | None = None,
) -> Request:
    """A real ``Request`` with its own prompt list and a deep copy of params."""
    params = copy.deepcopy(dict(kv_transfer_params)) if kv_transfer_params else None
    sampling = SamplingParams(
        max_tokens=1,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params is not None else None,
    )
    request = Request(
        request_id=request_id,
        prompt_token_ids=[(i % 997) + 1 for i in range(num_prompt_tokens)],
        sampling_params=sampling,
        pooling_params=None,
    )
    if status is not None:
        request.status = status
    return request


def make_kv_cache_blocks(block_ids: Sequence[Sequence[int]]) -> KVCacheBlocks:
    """Real ``KVCacheBlocks`` whose ``get_block_ids()`` is ``block_ids``."""
    return KVCacheBlocks(
        tuple([KVCacheBlock(block_id=b) for b in group] for group in block_ids)
    )


def make_scheduler_output(
    new_block_ids_to_zero: Sequence[int] | None = None,
) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    output.new_block_ids_to_zero = (
        list(new_block_ids_to_zero) if new_block_ids_to_zero is not None else None
    )
    return output


def block_id_source(start: int = 1) -> Iterator[int]:
    """Distinct block ids, never 0 (vLLM's null block)."""
    return itertools.count(start)
