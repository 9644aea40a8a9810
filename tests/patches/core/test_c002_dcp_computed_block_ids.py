"""The block ids covering a request's computed tokens count DCP-sharded
blocks by the tokens they span.

Under decode context parallelism a DCP-sharded block holds
``block_size * dcp_world_size`` tokens. The scheduler hands a finished
request's table to the KV connector clipped to its computed tokens
(``KVCacheManager.get_block_ids_for_computed_tokens``); clipped by the spec
block size, a table keeps a lookahead block past the prompt, and the
connector transfers it. The test drives the real ``KVCacheManager``.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

from tests.patches.builders import hashed_request

BLOCK_SIZE = 16


@pytest.mark.parametrize("dcp", [2, 4])
def test_computed_block_ids_count_dcp_sharded_blocks(dcp: int) -> None:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.bfloat16,
        dcp_sharded=True,
    )
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["attn.0"], spec)],
    )
    span = BLOCK_SIZE * dcp
    manager = KVCacheManager(
        config,
        max_model_len=8 * span,
        scheduler_block_size=span,
        hash_block_size=span,
        enable_caching=False,
        dcp_world_size=dcp,
    )
    # One token short of a block, and lookahead slots reaching the next one.
    num_tokens = span - 1
    request = hashed_request("req-0", list(range(num_tokens)), span)
    assert manager.allocate_slots(request, num_tokens, num_lookahead_tokens=8)
    [table] = manager.get_block_ids("req-0")
    assert len(table) == 2

    [clipped] = manager.get_block_ids_for_computed_tokens("req-0", num_tokens)

    assert clipped == table[:1]
