"""The scheduler tells the KV connector each group's local prefix-cache hit.

A KV connector that completes divergent local hybrid hits
(``supports_divergent_local_hybrid_hits``) has each KV cache group looked up
on its own, and is told the full-attention group's hit. An EAGLE drafter
owning its group hits a block less (the KV cache manager drops its last
matched block) and gets a fresh block there, which the connector must fill:
the request carries each group's hit (``num_local_hit_tokens_per_group``)
to ``update_state_after_alloc``. The tests drive the real ``Scheduler``.
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
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheGroupSpec
from vllm.v1.request import Request

from tests.patches.builders import (
    full_attention_spec,
    hashed_request,
    kda_mamba_spec,
    make_kv_cache_config,
    make_vllm_config,
)
from tests.patches.vllm_unit_utils import (
    create_model_runner_output,
    create_scheduler,
)

BLOCK_SIZE = 16
SHARED = list(range(1, 10 * BLOCK_SIZE + 1))
NUM_PROMPT_TOKENS = 220


class RemotePrefillConnector(KVConnectorBase_V1, SupportsHMA):
    """Loads every prompt token of a remotely prefilled request past the
    local hit but the last, synchronously; records what each allocation
    tells it."""

    seen: dict[str, Any] = {}

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return True

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not (request.kv_transfer_params or {}).get("do_remote_prefill"):
            return 0, False
        return request.num_prompt_tokens - 1 - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        type(self).seen[request.request_id] = getattr(
            request, "num_local_hit_tokens_per_group", None
        )

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


def _scheduler(
    model_dir: Path, use_drafter: bool, connector: str = "RemotePrefillConnector"
) -> Scheduler:
    """Target full attention, a KDA state group and, with ``use_drafter``,
    an MTP drafter's full-attention group of its own."""
    vllm_config = make_vllm_config(
        model_dir,
        KVTransferConfig(
            kv_connector=connector,
            kv_role="kv_consumer",
            kv_connector_module_path=__name__,
        ),
        block_size=BLOCK_SIZE,
        speculative_config=(
            {"method": "mtp", "num_speculative_tokens": 1} if use_drafter else None
        ),
    )
    vllm_config.cache_config.mamba_cache_mode = "align"
    groups = [
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], full_attention_spec()),
        KVCacheGroupSpec(["model.layers.0.linear_attn"], kda_mamba_spec(BLOCK_SIZE)),
    ]
    if use_drafter:
        groups.append(
            KVCacheGroupSpec(
                ["model.layers.2.self_attn.attn"],
                full_attention_spec(head_size=128),
                is_eagle_group=True,
            )
        )
    kv_cache_config = make_kv_cache_config(groups, 512)
    with set_current_vllm_config(vllm_config):
        return create_scheduler(vllm_config, 512, kv_cache_config)


def _run_locally(scheduler: Scheduler, request: Request) -> None:
    scheduler.add_request(request)
    while request.request_id in scheduler.requests:
        output = scheduler.schedule()
        reqs = [scheduler.requests[r] for r in output.num_scheduled_tokens]
        scheduler.update_from_output(output, create_model_runner_output(reqs))


def _admit_with_hit(scheduler: Scheduler, request_id: str) -> Any:
    """Cache the shared prefix, then admit a remotely prefilled prompt
    sharing it; what the connector was told at its allocation."""
    warm = [*SHARED, *[7] * 40]
    _run_locally(scheduler, hashed_request(f"warm-{request_id}", warm, BLOCK_SIZE))
    tokens = [*SHARED, *[9] * (NUM_PROMPT_TOKENS - len(SHARED))]
    params = {"do_remote_prefill": True}
    scheduler.add_request(hashed_request(request_id, tokens, BLOCK_SIZE, params))
    output = scheduler.schedule()
    assert request_id in output.num_scheduled_tokens
    return RemotePrefillConnector.seen.pop(request_id)


class ReconcilingConnector(RemotePrefillConnector):
    """The same, without divergent local hybrid hits: the manager reconciles
    one hit every group holds."""

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return False


@pytest.mark.parametrize(
    ("use_drafter", "expected"),
    [
        # The drafter's lookup drops its last matched block; the KDA state
        # group holds no state at the shared prefix's end.
        (True, (10 * BLOCK_SIZE, 0, 9 * BLOCK_SIZE)),
        (False, (10 * BLOCK_SIZE, 0)),
    ],
    ids=["drafter", "no-drafter"],
)
def test_each_group_hit_reaches_the_connector(
    deepseek_mtp_model_dir: Path, use_drafter: bool, expected: tuple[int, ...]
):
    """The connector is told each group's own hit, the full-attention
    group's being the one it gets as the local hit."""
    scheduler = _scheduler(deepseek_mtp_model_dir, use_drafter)

    assert _admit_with_hit(scheduler, "req-0") == expected


def test_a_reconciled_hit_states_no_per_group_hits(deepseek_mtp_model_dir: Path):
    """Guard: where the manager reconciles one hit, every group holds the
    hit the connector is told, and the request says nothing more."""
    scheduler = _scheduler(
        deepseek_mtp_model_dir, use_drafter=True, connector="ReconcilingConnector"
    )

    assert _admit_with_hit(scheduler, "req-1") is None
