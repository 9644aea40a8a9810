"""Patch 0003: with a decoder prefix hit, hybrid READ reads only the
full-attention pages the decoder lacks.

Drives the real scheduler-side connector: a producer finishes the prefill
(``request_finished_all_groups``), a consumer admits the same prompt
(``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``) with position-indexed tables as the KV cache manager
hands them over: page k of a group holds tokens [k*P, (k+1)*P), P the group's
block size times the DCP size when the spec is DCP-sharded.

A group holds locally the pages of its own prefix hit. Groups that share the
target's spec are looked up together and share the request's hit; an EAGLE
drafter owning a group of its own can hit fewer pages (the KV cache manager
drops its last matched page), so that group must read every page it lacks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.patches.conftest import (
    full_attention_spec,
    kda_mamba_spec,
    make_kv_cache_blocks,
    make_kv_cache_config,
    make_request,
    make_scheduler_connector,
    make_scheduler_output,
    make_vllm_config,
    mla_spec,
    moriio_kv_transfer_config,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    MoRIIOError,
)
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector import (
    MoRIIOConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheSpec
from vllm.v1.request import Request, RequestStatus

# Block ids encode (leg, group, page); 0 is vLLM's null block.
_PREFILL_BASE = 10_000_000
_DECODE_BASE = 20_000_000
_GROUP_STRIDE = 100_000


@dataclass(frozen=True)
class Group:
    """One KV cache group of a hybrid layout.

    kind: "target" (the model's MLA group; every target group has the same
    spec, so they share one prefix hit), "drafter" (an EAGLE drafter owning a
    full-attention group of its own spec), "kda" (recurrent state).
    """

    kind: str
    block_size: int = 16
    dcp_sharded: bool = False
    host_resident: bool = False

    def spec(self) -> KVCacheSpec:
        if self.kind == "target":
            return mla_spec(self.block_size, dcp_sharded=self.dcp_sharded)
        if self.kind == "drafter":
            return full_attention_spec(
                self.block_size, head_size=128, dcp_sharded=self.dcp_sharded
            )
        assert self.kind == "kda"
        return kda_mamba_spec(16)

    def group_spec(self, index: int) -> KVCacheGroupSpec:
        return KVCacheGroupSpec(
            [f"layer.{index}"],
            self.spec(),
            is_eagle_group=self.kind == "drafter",
            host_resident=self.host_resident,
        )

    def page_tokens(self, dcp: int) -> int:
        return self.block_size * (dcp if self.dcp_sharded else 1)


def connector(
    model_dir: Path, groups: Sequence[Group], dcp: int, role: str
) -> MoRIIOConnector:
    vllm_config = make_vllm_config(model_dir, moriio_kv_transfer_config(role))
    vllm_config.parallel_config.decode_context_parallel_size = dcp
    kv_cache_config = make_kv_cache_config(
        [group.group_spec(i) for i, group in enumerate(groups)]
    )
    return make_scheduler_connector(vllm_config, kv_cache_config)


def table(base: int, index: int, group: Group, num_tokens: int, dcp: int) -> list[int]:
    """A position-indexed table covering ``num_tokens`` (one slot for KDA)."""
    if group.kind == "kda":
        return [base + index * _GROUP_STRIDE]
    num_pages = max(-(-num_tokens // group.page_tokens(dcp)), 0)
    return [base + index * _GROUP_STRIDE + page for page in range(num_pages)]


_request_ids = itertools.count()


@dataclass
class ReadPlan:
    """The consumer's READ pairs per attention group, as (local, remote) page
    indices, keyed by KV cache group index."""

    pairs: dict[int, list[tuple[int, int]]]

    def pages(self, group_index: int) -> list[int]:
        assert all(local == remote for local, remote in self.pairs[group_index])
        return [local for local, _ in self.pairs[group_index]]


def finish_prefill(
    model_dir: Path,
    groups: Sequence[Group],
    dcp: int,
    request_id: str,
    num_prompt_tokens: int,
    prefill_tail_pages: int = 0,
) -> dict:
    producer = connector(model_dir, groups, dcp, "kv_producer")
    prefill = make_request(
        request_id,
        num_prompt_tokens,
        {"do_remote_decode": True, "transfer_id": request_id},
    )
    producer.on_new_request(prefill)
    assert prefill.num_prompt_tokens == num_prompt_tokens - 1
    prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
    tables = tuple(
        table(
            _PREFILL_BASE,
            i,
            group,
            prefill.num_prompt_tokens + prefill_tail_pages * group.page_tokens(dcp),
            dcp,
        )
        for i, group in enumerate(groups)
    )
    delay_free, params = producer.request_finished_all_groups(prefill, tables)
    assert delay_free and params is not None
    return params


def read_plan(
    consumer: MoRIIOConnector, groups: Sequence[Group], request_id: str
) -> ReadPlan:
    meta = consumer.build_connector_meta(make_scheduler_output())
    req_meta = meta.reqs_to_recv[request_id]
    scheduler = consumer.connector_scheduler
    assert scheduler is not None
    payload_groups = [*scheduler._attn_group_ids, *scheduler._mamba_group_ids]
    assert len(req_meta.local_block_ids) == len(payload_groups)
    assert len(req_meta.remote_block_ids) == len(payload_groups)
    plan = ReadPlan({})
    for slot, group_index in enumerate(payload_groups):
        if groups[group_index].kind == "kda":
            continue
        local = list(req_meta.local_block_ids[slot])
        remote = list(req_meta.remote_block_ids[slot])
        assert len(local) == len(remote)
        assert all(b // _GROUP_STRIDE == (_DECODE_BASE // _GROUP_STRIDE + group_index)
                   for b in local)  # fmt: skip
        plan.pairs[group_index] = [
            (lb % _GROUP_STRIDE, rb % _GROUP_STRIDE)
            for lb, rb in zip(local, remote, strict=True)
        ]
    return plan


def run_transfer(
    model_dir: Path,
    groups: Sequence[Group],
    *,
    dcp: int,
    num_prompt_tokens: int,
    local_hit_tokens: int,
    final_external_tokens: int | None = None,
    decode_tail_tokens: int = 1,
    prefill_tail_pages: int = 0,
    short_local_group: int | None = None,
) -> ReadPlan:
    """Finish a prefill on a producer and admit it on a consumer.

    ``local_hit_tokens`` is the decoder's local hit as the scheduler reports it
    to ``get_num_new_matched_tokens``; ``final_external_tokens`` overrides the
    count the scheduler finally passes to ``update_state_after_alloc``.
    ``short_local_group`` gives that group's decoder table one page too few.
    """
    request_id = f"req-{next(_request_ids)}"
    params = finish_prefill(
        model_dir, groups, dcp, request_id, num_prompt_tokens, prefill_tail_pages
    )
    consumer = connector(model_dir, groups, dcp, "kv_consumer")
    decode = make_request(request_id, num_prompt_tokens, params)
    reported, load_async = consumer.get_num_new_matched_tokens(decode, local_hit_tokens)
    assert not load_async
    external = reported if final_external_tokens is None else final_external_tokens
    tables = [
        table(_DECODE_BASE, i, group, num_prompt_tokens + decode_tail_tokens, dcp)
        for i, group in enumerate(groups)
    ]
    if short_local_group is not None:
        tables[short_local_group] = tables[short_local_group][:-1]
    consumer.update_state_after_alloc(decode, make_kv_cache_blocks(tables), external)
    return read_plan(consumer, groups, request_id)


def missing_pages(num_prompt_tokens: int, hit_tokens: int, page: int) -> list[int]:
    """Pages holding a position in [hit, N-1): not held locally, computed by P."""
    end = num_prompt_tokens - 1
    if hit_tokens >= end:
        return []
    return list(range(hit_tokens // page, -(-end // page)))


def all_pages(num_prompt_tokens: int, page: int) -> list[int]:
    return missing_pages(num_prompt_tokens, 0, page)


HITS = ["none", "partial", "page_aligned", "one_short_of_full"]


def hit_tokens_for(hit: str, page: int, num_prompt_tokens: int) -> int:
    full_pages = (num_prompt_tokens - 1) // page
    return {
        "none": 0,
        "partial": page * (full_pages // 2),
        "page_aligned": page * 2,
        # The last page the decoder could hold, with E > 0.
        "one_short_of_full": page * full_pages
        if (num_prompt_tokens - 1) % page
        else page * (full_pages - 1),
    }[hit]


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


def test_capped_external_count_still_fills_from_the_local_hit(llama_model_dir: Path):
    """A capped external count (L + E < N - 1, e.g. rounded to a block) leaves
    [L + E, N) to the decoder's forward, and [L, L + E) to READ: every page
    from the local hit on is read, not only the last E tokens' pages."""
    groups = [Group("target", 128), Group("kda")]
    num_prompt_tokens = 128 * 8 + 7
    hit_tokens = 128 * 2
    plan = run_transfer(
        llama_model_dir,
        groups,
        dcp=1,
        num_prompt_tokens=num_prompt_tokens,
        local_hit_tokens=hit_tokens,
        final_external_tokens=128 * 3,
    )
    assert plan.pages(0) == missing_pages(num_prompt_tokens, hit_tokens, 128)


# ---------------------------------------------------------------------------
# Several attention groups; the EAGLE drafter owning its group
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


def test_target_spec_in_another_block_pool_reads_every_page(llama_model_dir: Path):
    """An equal spec in the host pool is looked up apart from the device
    groups, so its hit can be shorter: it reads every prompt page."""
    host = Group("target", 64, host_resident=True)
    groups = [Group("target", 64), host, Group("kda")]
    num_prompt_tokens = 64 * 10 + 9
    hit_tokens = 64 * 6
    plan = run_transfer(
        llama_model_dir,
        groups,
        dcp=1,
        num_prompt_tokens=num_prompt_tokens,
        local_hit_tokens=hit_tokens,
    )
    assert plan.pages(0) == missing_pages(num_prompt_tokens, hit_tokens, 64)
    assert plan.pages(1) == all_pages(num_prompt_tokens, 64)


@pytest.mark.parametrize("drafter_block", [64, 128])
def test_drafter_own_group_reads_every_page_it_lacks(
    llama_model_dir: Path, drafter_block: int
):
    """The drafter's hit is a page shorter than the target's; the target reads
    only its missing pages, the drafter group reads every prompt page."""
    groups = [Group("target", 128), Group("drafter", drafter_block), Group("kda")]
    num_prompt_tokens = 128 * 8 + 7
    hit_tokens = 128 * 5
    plan = run_transfer(
        llama_model_dir,
        groups,
        dcp=1,
        num_prompt_tokens=num_prompt_tokens,
        local_hit_tokens=hit_tokens,
    )
    assert plan.pages(0) == missing_pages(num_prompt_tokens, hit_tokens, 128)
    drafter_hit = hit_tokens - drafter_block
    drafter_pages = plan.pages(1)
    assert set(missing_pages(num_prompt_tokens, drafter_hit, drafter_block)) <= set(
        drafter_pages
    )
    assert drafter_pages == all_pages(num_prompt_tokens, drafter_block)


def _hashed_request(
    request_id: str, tokens: list[int], block_size: int, params: dict | None = None
) -> Request:
    init_none_hash(sha256)
    return Request(
        request_id,
        tokens,
        SamplingParams(
            max_tokens=1,
            extra_args={"kv_transfer_params": params} if params is not None else None,
        ),
        None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


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
    earlier = _hashed_request("earlier", [*shared, *[7] * 40], block)
    no_hit = manager.get_computed_blocks(earlier)[0]
    assert manager.allocate_slots(earlier, 200, 0, no_hit) is not None
    earlier.num_computed_tokens = 200
    manager.free(earlier)

    request_id = f"req-{next(_request_ids)}"
    params = finish_prefill(llama_model_dir, groups, 1, request_id, num_prompt_tokens)
    decode = _hashed_request(request_id, [*shared, *[9] * 60], block, params)
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


# ---------------------------------------------------------------------------
# Property: pages read = pages missing, both legs, same page index
# ---------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[Group], int, int, int, int]:
    """Target groups (one spec) and KDA groups in any order; an optional
    EAGLE drafter group after the first target group (draft layers follow
    the model's)."""
    dcp = draw(st.sampled_from([1, 2, 4, 8]))
    target = Group(
        "target",
        draw(st.sampled_from([16, 32, 64, 128, 192, 256])),
        dcp_sharded=draw(st.booleans()),
    )
    groups = draw(
        st.permutations(
            [target] * draw(st.integers(1, 3))
            + [Group("kda")] * draw(st.integers(1, 2))
        )
    )
    if draw(st.booleans()):
        drafter = Group(
            "drafter",
            draw(st.sampled_from([16, 64, 128])),
            dcp_sharded=draw(st.booleans()),
        )
        first_target = groups.index(target)
        at = draw(st.integers(first_target + 1, len(groups)))
        groups = [*groups[:at], drafter, *groups[at:]]
    page = target.page_tokens(dcp)
    num_prompt_tokens = draw(st.integers(2, 6000))
    hit_tokens = page * draw(st.integers(0, (num_prompt_tokens - 2) // page))
    lag_pages = draw(st.integers(0, 2))
    return list(groups), dcp, num_prompt_tokens, hit_tokens, lag_pages


@settings(max_examples=150, deadline=None)
@given(
    layout=layouts(),
    decode_tail_tokens=st.integers(1, 40),
    prefill_tail_pages=st.integers(0, 1),
)
def test_property_pages_read_are_pages_missing(
    llama_model_dir: Path,
    layout: tuple[list[Group], int, int, int, int],
    decode_tail_tokens: int,
    prefill_tail_pages: int,
):
    """Lookahead slots past the prompt on either leg change nothing."""
    groups, dcp, num_prompt_tokens, hit_tokens, lag_pages = layout
    plan = run_transfer(
        llama_model_dir,
        groups,
        dcp=dcp,
        num_prompt_tokens=num_prompt_tokens,
        local_hit_tokens=hit_tokens,
        decode_tail_tokens=decode_tail_tokens,
        prefill_tail_pages=prefill_tail_pages,
    )
    for index, group in enumerate(groups):
        if group.kind == "kda":
            continue
        page = group.page_tokens(dcp)
        if group.kind == "target":
            assert plan.pages(index) == missing_pages(
                num_prompt_tokens, hit_tokens, page
            )
        else:
            drafter_hit = max(hit_tokens // page - lag_pages, 0) * page
            read = plan.pages(index)
            assert set(missing_pages(num_prompt_tokens, drafter_hit, page)) <= set(read)
            assert read == all_pages(num_prompt_tokens, page)


def test_recorded_local_hit_is_released(llama_model_dir: Path):
    """The hit recorded by get_num_new_matched_tokens is dropped once the
    request is allocated, and when it finishes without an allocation."""
    groups = [Group("target", 64), Group("kda")]
    consumer = connector(llama_model_dir, groups, 1, "kv_consumer")
    scheduler = consumer.connector_scheduler
    assert scheduler is not None
    for allocate in (True, False):
        request_id = f"req-{next(_request_ids)}"
        params = finish_prefill(llama_model_dir, groups, 1, request_id, 64 * 4 + 3)
        decode = make_request(request_id, 64 * 4 + 3, params)
        consumer.get_num_new_matched_tokens(decode, 64)
        assert scheduler._local_hit_tokens == {request_id: 64}
        if allocate:
            tables = [
                table(_DECODE_BASE, i, g, 64 * 5, 1) for i, g in enumerate(groups)
            ]
            external = 64 * 4 + 3 - 1 - 64
            consumer.update_state_after_alloc(
                decode, make_kv_cache_blocks(tables), external
            )
        else:
            decode.status = RequestStatus.FINISHED_ABORTED
            consumer.request_finished_all_groups(decode, ([], []))
        assert scheduler._local_hit_tokens == {}
