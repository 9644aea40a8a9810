"""Patch 0005: with a decoder prefix hit, hybrid READ reads only the
full-attention pages the decoder lacks.

Each transfer runs through the real scheduler-side connector on both legs:
the decoder holds its local hit's pages, and per
full-attention group READ pairs the same page indices on both legs, from the
first page holding a token the decoder lacks to the page holding token N-2.
Groups that share the target's spec share the request's hit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    MoRIIOError,
)

from tests.patches.builders import (
    HITS,
    Group,
    TransferCase,
    hit_tokens_for,
    run_case,
    transfer_cases,
)

TARGET_128_KDA = (Group("target", 128), Group("kda"))
N_128 = 128 * 8 + 7
# The single-layout transfers below, by the test that runs each.
CASES = {
    "page_aligned_prefill": TransferCase(
        TARGET_128_KDA, 128 * 6 + 1, 128 * 4, prefill_tail_pages=1
    ),
    # The decoder's table for the first attention group is a page short.
    "incomplete_decode_table": TransferCase(
        TARGET_128_KDA,
        128 * 6 + 10,
        128 * 3,
        decode_tail_tokens=0,
        short_local_group=0,
    ),
    # The prefiller's tables end a page before the prompt does.
    "incomplete_prefill_table": TransferCase(
        TARGET_128_KDA, 128 * 6 + 10, 128 * 3, prefill_tail_pages=-1
    ),
    # The scheduler lowers the hit from 5 pages to 2 after asking.
    "final_external": TransferCase(
        TARGET_128_KDA, N_128, 128 * 5, final_external_tokens=N_128 - 1 - 128 * 2
    ),
    "targets_sharing_a_spec": TransferCase(
        (Group("target", 64), Group("kda"), Group("target", 64), Group("kda")),
        64 * 10 + 9,
        64 * 6,
    ),
}


# ---------------------------------------------------------------------------
# Selection per block size and hit
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("hit", HITS)
@pytest.mark.parametrize("block_size", [16, 128, 192])
def test_reads_only_missing_pages(llama_model_dir: Path, block_size: int, hit: str):
    groups = (Group("target", block_size), Group("kda"), Group("kda"))
    num_prompt_tokens = block_size * 9 + 5
    hit_tokens = hit_tokens_for(hit, block_size, num_prompt_tokens)
    case = TransferCase(groups, num_prompt_tokens, hit_tokens)
    assert case.plan(llama_model_dir).pages(0) == case.missing(0)


@pytest.mark.parametrize("hit", HITS)
def test_reads_only_missing_pages_dcp_sharded(llama_model_dir: Path, hit: str):
    dcp = 8
    groups = (Group("target", 64, dcp_sharded=True), Group("kda"))
    page = 64 * dcp
    num_prompt_tokens = page * 7 + 3
    hit_tokens = hit_tokens_for(hit, page, num_prompt_tokens)
    case = TransferCase(groups, num_prompt_tokens, hit_tokens, dcp=dcp)
    assert case.plan(llama_model_dir).pages(0) == case.missing(0)


def test_page_aligned_prefill_reads_no_page_past_it(llama_model_dir: Path):
    """N-1 on a page boundary: the prefill's lookahead page holds no prompt."""
    plan = CASES["page_aligned_prefill"].plan(llama_model_dir)
    assert plan.pages(0) == [4, 5]


# ---------------------------------------------------------------------------
# Fail closed on tables that do not cover the pages to read
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("leg", ["decode", "prefill"])
def test_incomplete_attention_table_raises(llama_model_dir: Path, leg: str):
    case = CASES[f"incomplete_{leg}_table"]
    with pytest.raises(MoRIIOError, match="complete full-attention tables"):
        case.plan(llama_model_dir)


# ---------------------------------------------------------------------------
# The external-token count that decides
# ---------------------------------------------------------------------------


def test_final_external_token_count_is_used(llama_model_dir: Path):
    """The scheduler can lower the local hit after asking the connector (it
    drops a local sub-block tail and takes the load instead); the count it
    passes to update_state_after_alloc decides which pages are missing."""
    case = CASES["final_external"]
    final_hit = 128 * 2
    assert case.plan(llama_model_dir).pages(0) == case.missing(0, final_hit)


# ---------------------------------------------------------------------------
# Several attention groups sharing the target's spec
# ---------------------------------------------------------------------------


def test_target_groups_sharing_a_spec_read_only_missing_pages(llama_model_dir: Path):
    case = CASES["targets_sharing_a_spec"]
    plan = case.plan(llama_model_dir)
    expected = case.missing(0)
    assert plan.pages(0) == expected
    assert plan.pages(2) == expected


# ---------------------------------------------------------------------------
# Property: pages read = pages missing, both legs, same page index
# ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(case=transfer_cases(with_drafter=False))
def test_property_pages_read_are_pages_missing(
    llama_model_dir: Path, case: TransferCase
):
    """Any target/KDA layout and hit; lookahead slots past the prompt on
    either leg change nothing."""
    run_case(llama_model_dir, case)
