"""A KV producer hands its connector the window blocks of the token the
consumer recomputes.

In P/D disaggregation the consumer is handed every prompt token but the
last and computes that one, N - 1, itself: it attends to positions N - W to
N - 1 of a W-token sliding window. When the producer's request finishes, the
scheduler frees the blocks out of the window before it hands the table to
the connector. Freed for the next token N, the block holding position N - W
is gone whenever N - W ends its block. The test drives the real
``Scheduler`` with a producer connector that records the table it is given.
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
from vllm.v1.request import Request

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
WINDOW = 32


class RecordingProducer(KVConnectorBase_V1, SupportsHMA):
    """Records the block table each finished request hands over."""

    handed_over: dict[str, tuple[list[int], ...]] = {}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        RecordingProducer.handed_over[request.request_id] = block_ids
        return False, None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

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


# N - W ends a block: N = W - 1 + k * BLOCK_SIZE.
@pytest.mark.parametrize("num_prompt_tokens", [WINDOW + 15, WINDOW + 47])
def test_producer_hands_over_the_window_of_the_recomputed_token(
    llama_model_dir: Path, num_prompt_tokens: int
) -> None:
    vllm_config = make_vllm_config(
        llama_model_dir,
        KVTransferConfig(
            kv_connector="RecordingProducer",
            kv_role="kv_producer",
            kv_connector_module_path=__name__,
        ),
        block_size=BLOCK_SIZE,
    )
    kv_cache_config = make_kv_cache_config(
        [
            (["attn.0"], full_attention_spec(BLOCK_SIZE)),
            (["attn.1"], sliding_window_spec(BLOCK_SIZE, WINDOW)),
        ],
        num_blocks=64,
    )
    with set_current_vllm_config(vllm_config):
        scheduler = create_scheduler(vllm_config, 64, kv_cache_config)
    request = hashed_request("req-0", list(range(num_prompt_tokens)), BLOCK_SIZE)
    scheduler.add_request(request)

    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"req-0": num_prompt_tokens}
    scheduler.update_from_output(
        output, model_runner_output(["req-0"], sampled_token_ids=[[7]])
    )

    _, window_table = RecordingProducer.handed_over["req-0"]
    # Position N - 1 attends to N - W on; every block from N - W's is real.
    first = (num_prompt_tokens - WINDOW) // BLOCK_SIZE
    null = scheduler.kv_cache_manager.block_pool.null_block.block_id
    assert len(window_table) > first
    assert null not in window_table[first:], (first, window_table)
