"""Patch 0015: READ posts no read for a request with nothing external to load.

vLLM's scheduler makes a step's KV load synchronous (``has_sync_kv_loads``,
started before the forward) only for a request with external tokens; with
none the model runner starts the load after the forward. A READ posted then
lands after the forward that needed it and into blocks the finished request
may already have freed. On a full local hit (E = 0) the decoder therefore
reads nothing and only releases the prefiller's blocks. The scheduler side
runs through the real connector on both legs (a GLM-like layout), the worker
through the real ``MoRIIOConnectorWorker`` over stubbed mori.
"""

from __future__ import annotations

import pytest

from tests.patches.builders import (
    GLM_PAYLOAD,
    B,
    build_worker,
    glm_like_groups,
    glm_transfer,
    make_kv_cache_config,
    read_blocks,
)

# N - 1 a multiple of B: a full local hit exists.
FULL_HIT_LENGTHS = (3 * B + 1, 7 * B + 1)


@pytest.mark.parametrize("n", FULL_HIT_LENGTHS)
def test_full_local_hit_reads_no_group(mtp_vllm_configs, n) -> None:
    """Every group pairs an empty list on both legs, the tail ring (never a
    prefix hit) included."""
    t = glm_transfer(mtp_vllm_configs, n, (n - 1) // B)
    assert t.local == [[] for _ in GLM_PAYLOAD]
    assert t.remote == [[] for _ in GLM_PAYLOAD]


@pytest.mark.parametrize("n", FULL_HIT_LENGTHS)
def test_full_local_hit_zeroes_as_without_a_transfer(mtp_vllm_configs, n) -> None:
    """No READ destination: vLLM zeroes the request's fresh blocks as usual."""
    t = glm_transfer(mtp_vllm_configs, n, (n - 1) // B)
    assert sorted(t.zero_after) == sorted(t.zero_before)


def test_worker_only_releases_when_every_list_is_empty(
    stub_mori, mtp_vllm_configs
) -> None:
    worker = build_worker(mtp_vllm_configs[1], make_kv_cache_config(glm_like_groups()))
    released: list[tuple[str, str]] = []
    worker._send_read_release = lambda transfer_id, host, ports: released.append(
        (transfer_id, host)
    )
    try:
        read_blocks(
            worker, [[] for _ in GLM_PAYLOAD], [[] for _ in GLM_PAYLOAD], "t-nothing"
        )
    finally:
        worker.shutdown()
    assert worker.moriio_wrapper.reads == []
    assert released == [("t-nothing", "127.0.0.1")]
