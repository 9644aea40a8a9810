"""Patch 0012: READ without a state group reads only the full-attention pages
the decoder lacks.

Without a state group the prefiller computes the whole prompt and the decoder
recomputes its last token: with a local hit of L tokens it loads [L, N - 1)
(the transfer is driven through the real connector on both legs). Without the
patch every prompt page is read whatever the hit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings

from tests.patches.builders import (
    Group,
    TransferCase,
    build_scheduler_pair,
    cdiv,
    full_attention_spec,
    hit_tokens_for,
    prompt,
    read_after_manager_hit,
    run_case,
    transfer_cases,
)

# Layouts without a state group, and the DCP size each runs with. The EAGLE
# drafter owns a group of its own spec; without a state group vLLM's KV cache
# coordinator reconciles one hit for every prefix-cacheable group, so the
# drafter's group holds the target's hit.
LAYOUTS = {
    "llama": ((Group("full", 16),), 1),
    "llama_dcp2": ((Group("full", 16, dcp_sharded=True),), 2),
    "mla_dcp4": ((Group("target", 64, dcp_sharded=True),), 4),
    "mla_eagle": ((Group("target", 64), Group("drafter", 64)), 1),
}


def _case(layout: str, num_prompt_tokens: int, hit: str, **run: int) -> TransferCase:
    groups, dcp = LAYOUTS[layout]
    page = groups[0].page_tokens(dcp)
    hit_tokens = hit_tokens_for(hit, page, num_prompt_tokens)
    return TransferCase(groups, num_prompt_tokens, hit_tokens, dcp=dcp, **run)


@pytest.mark.parametrize("hit", ["partial", "one_short_of_full"])
@pytest.mark.parametrize("num_prompt_tokens", [1000, 4001])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefix_hit_reads_only_missing_pages(
    llama_model_dir: Path, layout: str, num_prompt_tokens: int, hit: str
):
    case = _case(layout, num_prompt_tokens, hit)
    assert case.hit_tokens > 0
    plan = case.plan(llama_model_dir)
    for index in range(len(case.groups)):
        assert plan.pages(index) == case.missing(index)


@pytest.mark.parametrize("layout", ["llama", "mla_dcp4"])
def test_lookahead_tails_change_nothing(llama_model_dir: Path, layout: str):
    """Pages past the prompt on either leg (a decode lookahead, the
    prefiller's spare page) are not read."""
    case = _case(layout, 4001, "partial", decode_tail_tokens=40, prefill_tail_pages=1)
    assert case.plan(llama_model_dir).pages(0) == case.missing(0)


@pytest.mark.parametrize("layout", ["llama", "mla_eagle"])
def test_no_hit_reads_every_prompt_page(llama_model_dir: Path, layout: str):
    case = _case(layout, 1000, "none")
    plan = case.plan(llama_model_dir)
    for index in range(len(case.groups)):
        assert plan.pages(index) == case.missing(index)


def test_eagle_hit_from_the_kv_cache_manager(llama_model_dir: Path):
    """The real KV cache manager gives the target and the EAGLE drafter's own
    group one hit; each group reads exactly the pages it lacks."""
    groups = [Group("target", 16), Group("drafter", 16)]
    read = read_after_manager_hit(llama_model_dir, groups, 16, divergent=False)
    assert read.local_hit == 144 and read.held == [9, 9]
    for group_index in range(len(groups)):
        assert read.read[group_index] == read.lacking(group_index), group_index


def test_capped_external_count_reads_the_loaded_pages(llama_model_dir: Path):
    """Without a state group, L + E < N - 1 is served: the decoder loads
    [L, L + E) and computes the rest, so READ covers exactly those pages."""
    page, hit_pages, loaded_pages = 16, 4, 6
    case = TransferCase(
        (Group("full", page),),
        page * 20 + 3,
        page * hit_pages,
        final_external_tokens=page * loaded_pages,
    )
    pages = list(range(hit_pages, hit_pages + loaded_pages))
    assert case.plan(llama_model_dir).pages(0) == pages


@settings(max_examples=100, deadline=None)
@given(case=transfer_cases(with_drafter=False, with_state=False))
def test_property_pages_read_are_pages_missing(
    llama_model_dir: Path, case: TransferCase
):
    """Any layout of target groups without a state group, any hit, DCP and
    lookahead on either leg."""
    run_case(llama_model_dir, case)


def test_scheduler_pair_reads_only_missing_pages(llama_model_dir: Path) -> None:
    """Both legs are real vLLM schedulers with the MoRIIO connector (one
    full-attention group); a decoder warm-up gives the prefix hit, and its
    first step READs exactly the pages past the hit."""
    block = 16
    layers = [(["model.layers.0.self_attn.attn"], full_attention_spec(block))]
    pair = build_scheduler_pair(llama_model_dir, layers, block)
    wrong = []
    for n in (97, 160, 161, 203):
        hit = n // 2 // block * block
        read = pair.read(prompt(300 + n, n), hit)
        assert read.decode_hit_tokens == hit
        local = [read.decode_tables[0].index(b) for b in read.local_block_ids[0]]
        remote = [read.prefill_tables[0].index(b) for b in read.remote_block_ids[0]]
        lacked = list(range(hit // block, cdiv(n - 1, block)))
        if local != lacked or remote != lacked:
            wrong.append(f"N={n}: decoder pages {local}, prefiller pages {remote}")
    assert not wrong, wrong
