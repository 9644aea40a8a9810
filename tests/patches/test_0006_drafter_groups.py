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
from vllm.v1.core.kv_cache_manager import KVCacheManager

from tests.patches.builders import (
    Group,
    TransferCase,
    connector,
    finish_prefill,
    hashed_request,
    make_kv_cache_config,
    make_scheduler_output,
    next_request_id,
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
    block = 16
    groups = [Group("target", block), Group("drafter", block), Group("kda")]
    manager = KVCacheManager(
        make_kv_cache_config([g.group_spec(i) for i, g in enumerate(groups)], 512),
        max_model_len=4096,
        scheduler_block_size=block,
        hash_block_size=block,
        use_eagle=True,
    )
    num_prompt_tokens = 220
    shared = list(range(1, 161))
    earlier = hashed_request("earlier", [*shared, *[7] * 40], block)
    no_hit = manager.get_computed_blocks(earlier)[0]
    assert manager.allocate_slots(earlier, 200, 0, no_hit) is not None
    earlier.num_computed_tokens = 200
    manager.free(earlier)

    request_id = next_request_id()
    params = finish_prefill(llama_model_dir, groups, 1, request_id, num_prompt_tokens)
    decode = hashed_request(request_id, [*shared, *[9] * 60], block, params)
    hit_blocks, local_hit, _, diverged = manager.get_computed_blocks_for_connector(
        decode
    )
    held = [len(b) for b in hit_blocks.get_block_ids()]
    assert diverged and local_hit == 160 and held[:2] == [10, 9]

    consumer = connector(llama_model_dir, groups, 1, "kv_consumer")
    external, _ = consumer.get_num_new_matched_tokens(decode, local_hit)
    assert external == num_prompt_tokens - 1 - local_hit
    assert (
        manager.allocate_slots(
            decode,
            num_prompt_tokens - local_hit - external,
            num_new_computed_tokens=local_hit,
            new_computed_blocks=hit_blocks,
            num_external_computed_tokens=external,
        )
        is not None
    )
    allocated = manager.get_blocks(request_id)
    consumer.update_state_after_alloc(decode, allocated, external)

    scheduler = consumer.connector_scheduler
    assert scheduler is not None
    meta = consumer.build_connector_meta(make_scheduler_output())
    req_meta = meta.reqs_to_recv[request_id]
    for slot, group_index in enumerate(scheduler._attn_group_ids):
        table_ids = allocated.get_block_ids()[group_index]
        read = set(req_meta.local_block_ids[slot])
        end = -(-(num_prompt_tokens - 1) // block)
        lacking = set(table_ids[held[group_index] : end])
        assert lacking <= read, f"group {group_index} leaves pages unread"
        if group_index == 0:
            assert read == lacking


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
