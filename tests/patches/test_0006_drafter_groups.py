"""Patch 0006: full-attention groups that do not share the request's prefix
hit read every prompt page.

The scheduler reports the hit of the first prefix-cacheable full-attention
group; groups with that spec in the same block pool are looked up with it.
An EAGLE drafter owning a group of its own can hit fewer pages (the KV cache
manager drops its last matched page), and an equal spec in the host pool is
looked up on its own: such a group must read every page it lacks. The
first tests admit the request on a real decode ``Scheduler``; the others
drive the real connector on both legs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from vllm.config import set_current_vllm_config
from vllm.v1.core.sched.scheduler import Scheduler

from tests.patches.builders import (
    Group,
    TransferCase,
    cdiv,
    finish_prefill,
    hashed_request,
    make_kv_cache_config,
    make_vllm_config,
    moriio_kv_transfer_config,
    read_after_manager_hit,
    run_case,
    transfer_cases,
)
from tests.patches.vllm_unit_utils import (
    create_model_runner_output,
    create_scheduler,
)

# ---------------------------------------------------------------------------
# A real decode Scheduler
# ---------------------------------------------------------------------------

BLOCK = 16
SHARED = list(range(1, 10 * BLOCK + 1))
NUM_PROMPT_TOKENS = 220
LAYOUTS = {
    # Qwen3.5-EAGLE3-like: the drafter owns a full-attention group.
    "target-drafter-kda": ("full", "drafter", "kda"),
    "two-targets-drafter-kda": ("full", "full", "drafter", "kda"),
}


def _decode_scheduler(model_dir: Path, groups: list[Group]) -> Scheduler:
    """A READ consumer's ``Scheduler`` (MTP drafting, prefix caching on)."""
    vllm_config = make_vllm_config(
        model_dir,
        moriio_kv_transfer_config("kv_consumer"),
        block_size=BLOCK,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    vllm_config.cache_config.mamba_cache_mode = "align"
    kv_cache_config = make_kv_cache_config(
        [group.group_spec(i) for i, group in enumerate(groups)], 512
    )
    with set_current_vllm_config(vllm_config):
        return create_scheduler(vllm_config, 512, kv_cache_config)


def _cached_tables(scheduler: Scheduler, tokens: list[int]) -> list[list[int]]:
    """Run ``tokens`` locally; the blocks each group cached for them."""
    request = hashed_request("warm", tokens, BLOCK)
    scheduler.add_request(request)
    tables: list[list[int]] = []
    while "warm" in scheduler.requests:
        output = scheduler.schedule()
        tables = [list(t) for t in scheduler.kv_cache_manager.get_block_ids("warm")]
        reqs = [scheduler.requests[r] for r in output.num_scheduled_tokens]
        scheduler.update_from_output(output, create_model_runner_output(reqs))
    return tables


def _unread_lacking_pages(
    model_dir: Path, kinds: tuple[str, ...]
) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Cache a shared prefix on the decoder, then admit a remotely prefilled
    prompt sharing it: per attention group, the pages it holds from its
    prefix cache (a page of the shared prefix whose block is the one the
    earlier request cached there), and the pages it lacks that READ does
    not fill."""
    groups = [Group(kind, BLOCK) for kind in kinds]
    scheduler = _decode_scheduler(model_dir, groups)
    cached = _cached_tables(scheduler, [*SHARED, *[7] * 40])
    params = finish_prefill(model_dir, groups, 1, "req-0", NUM_PROMPT_TOKENS)
    tokens = [*SHARED, *[9] * (NUM_PROMPT_TOKENS - len(SHARED))]
    scheduler.add_request(hashed_request("req-0", tokens, BLOCK, params))
    # The step that allocates the request's blocks issues its READ, whether
    # the load is synchronous (scheduled in that step) or not.
    output = scheduler.schedule()
    tables = scheduler.kv_cache_manager.get_block_ids("req-0")
    meta = output.kv_connector_metadata.reqs_to_recv["req-0"]
    connector = scheduler.connector
    assert connector is not None and connector.connector_scheduler is not None
    attn_group_ids = connector.connector_scheduler._attn_group_ids
    end = cdiv(NUM_PROMPT_TOKENS - 1, BLOCK)
    held_pages: dict[int, int] = {}
    unread: dict[int, list[int]] = {}
    for slot, group in enumerate(attn_group_ids):
        held = [
            page
            for page, block in enumerate(tables[group][:end])
            if page < len(SHARED) // BLOCK and block == cached[group][page]
        ]
        held_pages[group] = len(held)
        read = set(meta.local_block_ids[slot])
        unread[group] = [
            page
            for page, block in enumerate(tables[group][:end])
            if page not in held and block not in read
        ]
    return held_pages, unread


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_real_scheduler_reads_every_page_each_group_lacks(
    deepseek_mtp_model_dir: Path, layout: str
) -> None:
    """The drafter's own lookup hits a page less than the target's: the
    decoder READs that page too, and every other page a group lacks."""
    kinds = LAYOUTS[layout]
    held, unread = _unread_lacking_pages(deepseek_mtp_model_dir, kinds)
    drafter = kinds.index("drafter")
    assert held[0] == len(SHARED) // BLOCK and held[drafter] < held[0], held
    assert not any(unread.values()), f"pages lacked and not READ: {unread}"


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
