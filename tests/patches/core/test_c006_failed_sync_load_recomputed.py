"""A synchronous KV connector load that fails is recomputed, with any number
of KV cache groups.

A connector that loads synchronously writes the loaded blocks in the step
that computes on them, so the step's output is wrong when the load fails.
vLLM recovers such a failure only as ``invalid_block_ids``, which its
scheduler refuses with several KV cache groups (a ``RuntimeError`` out of
``update_from_output``); ``failed_recving`` acted only on asynchronous
loads. The test drives the real ``Scheduler`` with a connector that loads
every prompt token but the last synchronously and reports the load of
``req-0`` failed, by request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.config import KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from tests.patches.builders import (
    full_attention_spec,
    hashed_request,
    make_kv_cache_config,
    make_vllm_config,
    model_runner_output,
    sliding_window_spec,
)
from tests.patches.vllm_unit_utils import create_scheduler

BLOCK_SIZE = 16
NUM_PROMPT_TOKENS = 4 * BLOCK_SIZE + 1


class FailingSyncLoadConnector(KVConnectorBase_V1, SupportsHMA):
    """Loads every prompt token but the last, synchronously; a request whose
    load failed is computed locally when scheduled again."""

    failed: set[str] = set()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self.failed:
            return 0, False
        return request.num_prompt_tokens - 1 - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        pass

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.failed |= connector_output.failed_recving

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


LAYOUTS = {
    "full": [(["attn.0"], full_attention_spec(BLOCK_SIZE))],
    "full+window": [
        (["attn.0"], full_attention_spec(BLOCK_SIZE)),
        (["attn.1"], sliding_window_spec(BLOCK_SIZE, 2 * BLOCK_SIZE)),
    ],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_failed_sync_load_is_recomputed(llama_model_dir: Path, layout: str) -> None:
    vllm_config = make_vllm_config(
        llama_model_dir,
        KVTransferConfig(
            kv_connector="FailingSyncLoadConnector",
            kv_role="kv_consumer",
            kv_connector_module_path=__name__,
            kv_load_failure_policy="recompute",
        ),
        block_size=BLOCK_SIZE,
    )
    kv_cache_config = make_kv_cache_config(LAYOUTS[layout], num_blocks=64)
    with set_current_vllm_config(vllm_config):
        scheduler = create_scheduler(vllm_config, 64, kv_cache_config)
    FailingSyncLoadConnector.failed = set()
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    tokens = list(range(NUM_PROMPT_TOKENS))
    scheduler.add_request(hashed_request("req-0", tokens, BLOCK_SIZE))

    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"req-0": 1}
    loaded = {
        b for table in scheduler.kv_cache_manager.get_block_ids("req-0") for b in table
    }
    # The load failed: the worker reports it by request (finished_recving
    # too, as vLLM's output aggregator requires of a failed receive).
    result = scheduler.update_from_output(
        output,
        model_runner_output(
            ["req-0"],
            sampled_token_ids=[[7]],
            kv_connector_output=KVConnectorOutput(
                finished_recving={"req-0"}, failed_recving={"req-0"}
            ),
        ),
    )

    # No token computed on the failed load reaches the client.
    assert not [o for outs in result.values() for o in outs.outputs]
    request = scheduler.requests["req-0"]
    assert request.status == RequestStatus.PREEMPTED
    assert not request.output_token_ids
    # Its blocks went back to the pool, out of the prefix cache.
    assert pool.get_num_free_blocks() == free_before
    assert not any(pool.blocks[b].block_hash for b in loaded)

    output = scheduler.schedule()
    # Recomputed from its first token, all groups alike.
    assert output.num_scheduled_tokens == {"req-0": NUM_PROMPT_TOKENS}
    result = scheduler.update_from_output(
        output, model_runner_output(["req-0"], sampled_token_ids=[[7]])
    )
    outputs = [o for outs in result.values() for o in outs.outputs]
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("req-0", [7])]
