"""Patch 0006: full-attention groups that do not share the request's prefix
hit read every prompt page.

The scheduler reports the hit of the first prefix-cacheable full-attention
group; groups with that spec in the same block pool are looked up with it.
An EAGLE drafter owning a group of its own can hit fewer pages (the KV cache
manager drops its last matched page), and an equal spec in the host pool is
looked up on its own: such a group must read every page it lacks (the
transfer is driven through the real connector on both legs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings

from tests.patches.builders import (
    Group,
    TransferCase,
    read_after_manager_hit,
    run_case,
    transfer_cases,
)


def test_target_spec_in_another_block_pool_reads_every_page(llama_model_dir: Path):
    """An equal spec in the host pool is looked up apart from the device
    groups, so its hit can be shorter: it reads every prompt page."""
    host = Group("target", 64, host_resident=True)
    case = TransferCase((Group("target", 64), host, Group("kda")), 64 * 10 + 9, 64 * 6)
    plan = case.plan(llama_model_dir)
    assert plan.pages(0) == case.missing(0)
    assert plan.pages(1) == case.missing(1, 0)


@pytest.mark.parametrize("drafter_block", [64, 128])
def test_drafter_own_group_reads_every_page_it_lacks(
    llama_model_dir: Path, drafter_block: int
):
    """The drafter's hit is a page shorter than the target's; the target reads
    only its missing pages, the drafter group reads every prompt page."""
    groups = (Group("target", 128), Group("drafter", drafter_block), Group("kda"))
    case = TransferCase(groups, 128 * 8 + 7, 128 * 5)
    plan = case.plan(llama_model_dir)
    assert plan.pages(0) == case.missing(0)
    drafter_hit = case.hit_tokens - drafter_block
    drafter_pages = plan.pages(1)
    assert set(case.missing(1, drafter_hit)) <= set(drafter_pages)
    assert drafter_pages == case.missing(1, 0)


def test_drafter_hit_from_the_kv_cache_manager(llama_model_dir: Path):
    """The real KV cache manager gives the EAGLE drafter's own group a hit one
    page shorter than the target's; the pages it lacks are all read."""
    groups = [Group("target", 16), Group("drafter", 16), Group("kda")]
    read = read_after_manager_hit(llama_model_dir, groups, 16, divergent=True)
    assert read.diverged and read.local_hit == 160 and read.held[:2] == [10, 9]
    for slot, group_index in enumerate(read.attn_group_ids):
        pages = set(read.read[slot])
        lacking = set(read.lacking(group_index))
        assert lacking <= pages, f"group {group_index} leaves pages unread"
        if group_index == 0:
            assert pages == lacking


@settings(max_examples=100, deadline=None)
@given(case=transfer_cases(with_drafter=True))
def test_property_drafter_group_reads_every_page(
    llama_model_dir: Path, case: TransferCase
):
    """Whatever the drafter's own hit (up to two pages short of the
    target's), its group reads every page it lacks; the target groups still
    read only theirs."""
    plan = run_case(llama_model_dir, case)
    for index, group in enumerate(case.groups):
        if group.kind == "drafter":
            page = group.page_tokens(case.dcp)
            drafter_hit = max(case.hit_tokens // page - case.lag_pages, 0) * page
            read = plan.pages(index)
            assert set(case.missing(index, drafter_hit)) <= set(read)
            assert read == case.missing(index, 0)
