"""Patch 0005: with a decoder prefix hit, hybrid READ reads only the
full-attention pages the decoder lacks.

Each transfer runs through the real scheduler-side connector on both legs
(see ``prefix_hit_0005``): the decoder holds its local hit's pages, and per
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

from tests.patches.prefix_hit_0005 import (
    HITS,
    Group,
    TransferCase,
    hit_tokens_for,
    missing_pages,
    run_case,
    run_transfer,
    transfer_cases,
)

# ---------------------------------------------------------------------------
# Selection per block size and hit
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("hit", HITS)
@pytest.mark.parametrize("block_size", [16, 128, 192])
def test_reads_only_missing_pages(llama_model_dir: Path, block_size: int, hit: str):
    groups = [Group("target", block_size), Group("kda"), Group("kda")]
    num_prompt_tokens = block_size * 9 + 5
    hit_tokens = hit_tokens_for(hit, block_size, num_prompt_tokens)
    plan = run_transfer(
        llama_model_dir,
        groups,
        dcp=1,
        num_prompt_tokens=num_prompt_tokens,
        local_hit_tokens=hit_tokens,
    )
    assert plan.pages(0) == missing_pages(num_prompt_tokens, hit_tokens, block_size)


@pytest.mark.parametrize("hit", HITS)
def test_reads_only_missing_pages_dcp_sharded(llama_model_dir: Path, hit: str):
    dcp = 8
    groups = [Group("target", 64, dcp_sharded=True), Group("kda")]
    page = 64 * dcp
    num_prompt_tokens = page * 7 + 3
    hit_tokens = hit_tokens_for(hit, page, num_prompt_tokens)
    plan = run_transfer(
        llama_model_dir,
        groups,
        dcp=dcp,
        num_prompt_tokens=num_prompt_tokens,
        local_hit_tokens=hit_tokens,
    )
    assert plan.pages(0) == missing_pages(num_prompt_tokens, hit_tokens, page)


def test_page_aligned_prefill_reads_no_page_past_it(llama_model_dir: Path):
    """N-1 on a page boundary: the prefill's lookahead page holds no prompt."""
    groups = [Group("target", 128), Group("kda")]
    plan = run_transfer(
        llama_model_dir,
        groups,
        dcp=1,
        num_prompt_tokens=128 * 6 + 1,
        local_hit_tokens=128 * 4,
        prefill_tail_pages=1,
    )
    assert plan.pages(0) == [4, 5]


# ---------------------------------------------------------------------------
# Fail closed on tables that do not cover the pages to read
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("leg", ["decode", "prefill"])
def test_incomplete_attention_table_raises(llama_model_dir: Path, leg: str):
    groups = [Group("target", 128), Group("kda")]
    kwargs = (
        {"decode_tail_tokens": 0, "short_local_group": 0}
        if leg == "decode"
        else {"prefill_tail_pages": -1}
    )
    with pytest.raises(MoRIIOError, match="complete full-attention tables"):
        run_transfer(
            llama_model_dir,
            groups,
            dcp=1,
            num_prompt_tokens=128 * 6 + 10,
            local_hit_tokens=128 * 3,
            **kwargs,
        )


# ---------------------------------------------------------------------------
# The external-token count that decides
# ---------------------------------------------------------------------------


def test_final_external_token_count_is_used(llama_model_dir: Path):
    """The scheduler can lower the local hit after asking the connector (it
    drops a local sub-block tail and takes the load instead); the count it
    passes to update_state_after_alloc decides which pages are missing."""
    groups = [Group("target", 128), Group("kda")]
    num_prompt_tokens = 128 * 8 + 7
    final_hit = 128 * 2
    plan = run_transfer(
        llama_model_dir,
        groups,
        dcp=1,
        num_prompt_tokens=num_prompt_tokens,
        local_hit_tokens=128 * 5,
        final_external_tokens=num_prompt_tokens - 1 - final_hit,
    )
    assert plan.pages(0) == missing_pages(num_prompt_tokens, final_hit, 128)


# ---------------------------------------------------------------------------
# Several attention groups sharing the target's spec
# ---------------------------------------------------------------------------


def test_target_groups_sharing_a_spec_read_only_missing_pages(llama_model_dir: Path):
    groups = [Group("target", 64), Group("kda"), Group("target", 64), Group("kda")]
    num_prompt_tokens = 64 * 10 + 9
    hit_tokens = 64 * 6
    plan = run_transfer(
        llama_model_dir,
        groups,
        dcp=1,
        num_prompt_tokens=num_prompt_tokens,
        local_hit_tokens=hit_tokens,
    )
    expected = missing_pages(num_prompt_tokens, hit_tokens, 64)
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
