"""A synchronous KV connector load keeps its blocks out of KV cache zeroing.

vLLM zeroes freshly allocated blocks when the cache holds Mamba state or
mixes precisions (``KVCacheConfig.needs_kv_cache_zeroing``). A connector
whose load is synchronous writes the loaded blocks in the step that
allocates them, so zeroing them too races the load. The test drives the real
``Scheduler`` with a connector that loads every prompt token but the last
synchronously.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.request import Request

from tests.patches.builders import (
    hashed_request,
    make_kv_cache_config,
    make_vllm_config,
)
from tests.patches.vllm_unit_utils import create_scheduler

BLOCK_SIZE = 16
NUM_PROMPT_TOKENS = 2 * BLOCK_SIZE + 1


class SyncLoadConnector(KVConnectorBase_V1, SupportsHMA):
    """Loads every prompt token but the last, synchronously."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return request.num_prompt_tokens - 1 - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


def _spec(dtype: torch.dtype) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=dtype
    )


# Mixed precisions make the cache need zeroing; "full" is a cache whose
# zeroing another worker's layout requires.
LAYOUTS = {
    "full": [KVCacheGroupSpec(["attn.0"], _spec(torch.bfloat16))],
    "full+fp32-full": [
        KVCacheGroupSpec(["attn.0"], _spec(torch.bfloat16)),
        KVCacheGroupSpec(["state.0"], _spec(torch.float32)),
    ],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync_load_blocks_are_not_zeroed(llama_model_dir: Path, layout: str) -> None:
    vllm_config = make_vllm_config(
        llama_model_dir,
        KVTransferConfig(
            kv_connector="SyncLoadConnector",
            kv_role="kv_consumer",
            kv_connector_module_path=__name__,
        ),
        block_size=BLOCK_SIZE,
    )
    kv_cache_config = make_kv_cache_config(LAYOUTS[layout], num_blocks=64)
    kv_cache_config.needs_kv_cache_zeroing = True
    with set_current_vllm_config(vllm_config):
        scheduler = create_scheduler(vllm_config, 64, kv_cache_config)
    request = hashed_request("req-0", list(range(NUM_PROMPT_TOKENS)), BLOCK_SIZE)
    scheduler.add_request(request)

    output = scheduler.schedule()

    assert output.num_scheduled_tokens == {"req-0": 1}
    tables = scheduler.kv_cache_manager.get_block_ids("req-0")
    # The first two blocks hold the loaded tokens; the third, the one token
    # this step computes, is fresh and still zeroed.
    assert all(len(table) == 3 for table in tables)
    loaded = {b for table in tables for b in table[:2]}
    computed = {table[2] for table in tables}
    assert set(output.new_block_ids_to_zero or ()) == computed, loaded
