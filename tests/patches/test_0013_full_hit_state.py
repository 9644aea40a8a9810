"""Patch 0013: hybrid READ with nothing external to load reads no recurrent
state; a one-token prompt reads nothing.

On a full local hit (E = 0) the decoder holds the state after its hit: vLLM's
KV cache manager reconciles a divergent per-group hit whenever nothing is
loaded. The scheduler-side transfers run through the real connector on both
legs (a Kimi-like and a GLM-like layout), the worker's reads through the
real ``MoRIIOConnectorWorker`` over stubbed mori.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    MoRIIOError,
)

from tests.patches.builders import (
    GLM_MAMBA,
    TAIL_LAYERS,
    B,
    Group,
    TransferCase,
    build_worker,
    glm_like_groups,
    glm_transfer,
    make_kv_cache_config,
    read_blocks,
)

# Kimi-like: MLA (DCP-sharded) and two KDA groups.
KIMI_LIKE = (Group("target", 64, dcp_sharded=True), Group("kda"), Group("kda"))
# N - 1 a multiple of B: a full local hit exists.
FULL_HIT_LENGTHS = (3 * B + 1, 7 * B + 1)


@pytest.mark.parametrize("pages", [1, 4])
@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_full_local_hit_reads_no_state(llama_model_dir: Path, dcp: int, pages: int):
    """A decoder holding all N - 1 prompt tokens loads nothing: no page and
    no state slot is read, whatever either leg's lookahead tail."""
    n = KIMI_LIKE[0].page_tokens(dcp) * pages + 1
    case = TransferCase(
        KIMI_LIKE, n, n - 1, dcp=dcp, decode_tail_tokens=2, prefill_tail_pages=1
    )
    plan = case.plan(llama_model_dir)
    assert plan.pages(0) == []
    assert plan.states == {1: ([], []), 2: ([], [])}


@pytest.mark.parametrize("dcp", [1, 4])
def test_one_token_prompt_reads_nothing(llama_model_dir: Path, dcp: int):
    """Nothing precedes the token the decoder computes: no KV to read."""
    plan = TransferCase(KIMI_LIKE, 1, 0, dcp=dcp).plan(llama_model_dir)
    assert plan.pages(0) == []
    assert plan.states == {1: ([], []), 2: ([], [])}


def test_state_is_read_one_page_short_of_a_full_hit(llama_model_dir: Path):
    """Tokens to load: the page and each group's running-state slot are read."""
    n = 64 * 4 + 1
    plan = TransferCase(KIMI_LIKE, n, 64 * 3).plan(llama_model_dir)
    assert plan.pages(0) == [3]
    assert plan.states == {1: ([0], [0]), 2: ([0], [0])}


@pytest.mark.parametrize("n", FULL_HIT_LENGTHS)
def test_glm_full_local_hit_reads_no_state(mtp_vllm_configs, n) -> None:
    """No state slot and no prefix-cacheable attention page is read."""
    t = glm_transfer(mtp_vllm_configs, n, (n - 1) // B)
    assert t.local[0] == t.remote[0] == []
    for payload_index in (2, 3):
        assert t.local[payload_index] == t.remote[payload_index] == []


def test_worker_reads_the_ring_without_state(stub_mori, mtp_vllm_configs) -> None:
    worker = build_worker(mtp_vllm_configs[1], make_kv_cache_config(glm_like_groups()))
    try:
        reads = read_blocks(worker, [[], [201, 202], [], []], [[], [211, 212], [], []])
    finally:
        worker.shutdown()
    posted = [(session.layer, local) for session, local, _ in reads if local]
    assert {layer for layer, _ in posted} == set(TAIL_LAYERS)
    assert all(local == [201, 202] for _, local in posted)


def test_worker_refuses_a_state_slot_on_one_leg(stub_mori, mtp_vllm_configs) -> None:
    worker = build_worker(mtp_vllm_configs[1], make_kv_cache_config(glm_like_groups()))
    try:
        with pytest.raises(MoRIIOError, match="missing mamba recurrent-state"):
            read_blocks(worker, [[], [201], [], [401]], [[], [211], [], []])
    finally:
        worker.shutdown()


def test_state_is_read_when_tokens_are_loaded(mtp_vllm_configs) -> None:
    n = FULL_HIT_LENGTHS[0]
    t = glm_transfer(mtp_vllm_configs, n, 1)
    for payload_index, group_id in ((2, GLM_MAMBA[0]), (3, GLM_MAMBA[1])):
        assert t.local[payload_index] == [t.d.running_slot[group_id]]
        assert t.remote[payload_index] == [t.p.running_slot[group_id]]
