"""Stand-ins for helpers of vLLM's ``tests/v1/kv_connector/unit/utils.py``.

vLLM's KV-connector unit tests build their scheduler and model-runner
outputs with that module's ``create_scheduler`` and
``create_model_runner_output``. vLLM's test tree is not in the wheel these
tests run against, so this module provides the same two names with the same
parameters and results, written here. A test ported to vLLM's tree
imports vLLM's own helpers instead (``from .utils import ...``, as
``test_moriio_connector.py`` does); nothing else of this module goes into a
port.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

# vLLM 0.33.0's ModelRunnerOutput still took req_id_to_index.
_TAKES_ROW_MAP = "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters

EOS_TOKEN_ID = 50256


def create_scheduler(
    vllm_config: VllmConfig,
    num_blocks: int = 10000,
    kv_cache_config: KVCacheConfig | None = None,
    hash_block_size: int | None = None,
) -> Scheduler:
    """A real ``Scheduler`` with ``num_blocks`` blocks over
    ``kv_cache_config`` (default: one full-attention group of one layer),
    the KV connector of ``vllm_config`` built by it."""
    block_size = vllm_config.cache_config.block_size
    if kv_cache_config is None:
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )


def create_model_runner_output(
    reqs: list[Request],
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    use_eos: bool = False,
    token_id: int = 0,
) -> ModelRunnerOutput:
    """One sampled token (``token_id``, or EOS) per request of ``reqs``, in
    order, and the connector's report when any is given."""
    req_ids = [r.request_id for r in reqs]
    reported = (finished_sending, finished_recving, invalid_block_ids)
    connector = None
    if any(v is not None for v in reported):
        connector = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=invalid_block_ids or set(),
        )
    fields: dict[str, Any] = {}
    if _TAKES_ROW_MAP:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=[[EOS_TOKEN_ID if use_eos else token_id] for _ in reqs],
        kv_connector_output=connector,
        **fields,
    )
