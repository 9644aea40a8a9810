"""Patch 0007: when the scheduler caps the external token count below what
the decoder lacks (L + E < N - 1), hybrid READ fails closed.

The prefiller's recurrent state covers the first N - 1 prompt tokens; a
decoder that loads only [L, L + E) would compute [L + E, N - 1) on top of it a
second time (the transfer is driven through the real connector on both
legs).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    MoRIIOError,
)
from vllm.v1.request import RequestStatus

from tests.patches.builders import make_kv_cache_blocks, make_request
from tests.patches.prefix_hit_0005 import (
    Group,
    connector,
    decode_tables,
    finish_prefill,
    next_request_id,
)


@pytest.mark.parametrize(
    ("page", "num_prompt_tokens", "hit_tokens", "cap"),
    [
        # An external count capped well below N - 1 - L.
        (128, 128 * 8 + 7, 128 * 2, lambda e: 128 * 3),
        # vLLM's scheduler rounds the count down to a multiple of its block
        # size (here 256 tokens) for bounded-replay models; the group's
        # 64-token pages are smaller, so the rounding crosses a page.
        (64, 1125, 256, lambda e: e - e % 256),
    ],
    ids=["capped", "block_rounded"],
)
def test_capped_external_count_fails_closed(
    llama_model_dir: Path,
    page: int,
    num_prompt_tokens: int,
    hit_tokens: int,
    cap: Callable[[int], int],
):
    """L + E < N - 1 with a state group raises and queues no READ."""
    external = cap(num_prompt_tokens - 1 - hit_tokens)
    assert external > 0 and hit_tokens + external < num_prompt_tokens - 1
    groups = [Group("target", page), Group("kda")]
    request_id = next_request_id()
    params = finish_prefill(llama_model_dir, groups, 1, request_id, num_prompt_tokens)
    consumer = connector(llama_model_dir, groups, 1, "kv_consumer")
    scheduler = consumer.connector_scheduler
    assert scheduler is not None
    decode = make_request(request_id, num_prompt_tokens, params)
    consumer.get_num_new_matched_tokens(decode, hit_tokens)
    tables = decode_tables(groups, num_prompt_tokens + 1, 1)
    with pytest.raises(MoRIIOError, match="capped external token count"):
        scheduler.update_state_after_alloc(
            decode, make_kv_cache_blocks(tables), external
        )
    assert scheduler._reqs_need_recv == {}
    assert scheduler._local_hit_tokens == {}


def test_recorded_local_hit_is_released(llama_model_dir: Path):
    """The hit recorded by get_num_new_matched_tokens is dropped once the
    request is allocated, and when it finishes without an allocation."""
    groups = [Group("target", 64), Group("kda")]
    consumer = connector(llama_model_dir, groups, 1, "kv_consumer")
    scheduler = consumer.connector_scheduler
    assert scheduler is not None
    for allocate in (True, False):
        request_id = next_request_id()
        params = finish_prefill(llama_model_dir, groups, 1, request_id, 64 * 4 + 3)
        decode = make_request(request_id, 64 * 4 + 3, params)
        consumer.get_num_new_matched_tokens(decode, 64)
        assert scheduler._local_hit_tokens == {request_id: 64}
        if allocate:
            tables = decode_tables(groups, 64 * 5, 1)
            external = 64 * 4 + 3 - 1 - 64
            consumer.update_state_after_alloc(
                decode, make_kv_cache_blocks(tables), external
            )
        else:
            decode.status = RequestStatus.FINISHED_ABORTED
            consumer.request_finished_all_groups(decode, ([], []))
        assert scheduler._local_hit_tokens == {}
