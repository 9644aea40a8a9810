"""Drive a READ transfer with a decoder prefix hit through the real
scheduler-side MoRIIO connector, and read back the pages it pairs
(patches 0005, 0006, 0012 and 0013).

A producer finishes the prefill (``request_finished_all_groups``), a consumer
admits the same prompt (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``) with
position-indexed tables as the KV cache manager hands them over: page k of a
group holds tokens [k*P, (k+1)*P), P the group's block size times the DCP
size when the spec is DCP-sharded.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector import (
    MoRIIOConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    KVCacheGroupSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import Request, RequestStatus

from tests.patches.builders import (
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

# Block ids encode (leg, group, page); 0 is vLLM's null block.
_PREFILL_BASE = 10_000_000
_DECODE_BASE = 20_000_000
_GROUP_STRIDE = 100_000


@dataclass(frozen=True)
class Group:
    """One KV cache group of a layout.

    kind: "target" (the model's MLA group; every target group has the same
    spec, so they share one prefix hit), "full" (a Llama-like full-attention
    group), "drafter" (an EAGLE drafter owning a full-attention group of its
    own spec), "kda" (recurrent state), "wrapped" (the target's MLA layers and
    an fp8 indexer cache, a full-attention group in
    ``UniformTypeKVCacheSpecs`` as the workers' configs hold it).
    """

    kind: str
    block_size: int = 16
    dcp_sharded: bool = False
    host_resident: bool = False

    def layer_specs(self, index: int) -> dict[str, KVCacheSpec]:
        if self.kind != "wrapped":
            return {f"layer.{index}": self.spec()}
        return {
            f"layer.{index}.attn": mla_spec(
                self.block_size, dcp_sharded=self.dcp_sharded
            ),
            f"layer.{index}.indexer": mla_spec(
                self.block_size,
                head_size=132,
                dtype=torch.uint8,
                dcp_sharded=self.dcp_sharded,
            ),
        }

    def spec(self) -> KVCacheSpec:
        if self.kind == "target":
            return mla_spec(self.block_size, dcp_sharded=self.dcp_sharded)
        if self.kind == "full":
            return full_attention_spec(self.block_size, dcp_sharded=self.dcp_sharded)
        if self.kind == "drafter":
            return full_attention_spec(
                self.block_size, head_size=128, dcp_sharded=self.dcp_sharded
            )
        assert self.kind == "kda"
        return kda_mamba_spec(16)

    def group_spec(self, index: int) -> KVCacheGroupSpec:
        specs = self.layer_specs(index)
        spec = (
            UniformTypeKVCacheSpecs.from_specs(specs)
            if self.kind == "wrapped"
            else self.spec()
        )
        assert spec is not None
        return KVCacheGroupSpec(
            list(specs),
            spec,
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


def next_request_id() -> str:
    return f"req-{next(_request_ids)}"


def decode_tables(
    groups: Sequence[Group], num_tokens: int, dcp: int
) -> list[list[int]]:
    """The decoder's position-indexed tables covering ``num_tokens``."""
    return [table(_DECODE_BASE, i, g, num_tokens, dcp) for i, g in enumerate(groups)]


@dataclass
class ReadPlan:
    """The consumer's READ pairs per attention group, as (local, remote) page
    indices, and the state slots per KDA group, as (local, remote) lists of
    slot indices; both keyed by KV cache group index."""

    pairs: dict[int, list[tuple[int, int]]]
    states: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)

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
    # A hybrid prefiller leaves the last prompt token to the decoder.
    hybrid = any(group.kind == "kda" for group in groups)
    truncated = hybrid and num_prompt_tokens > 1
    expected = num_prompt_tokens - 1 if truncated else num_prompt_tokens
    assert prefill.num_prompt_tokens == expected
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
        local = list(req_meta.local_block_ids[slot])
        remote = list(req_meta.remote_block_ids[slot])
        if groups[group_index].kind == "kda":
            plan.states[group_index] = (
                [b % _GROUP_STRIDE for b in local],
                [b % _GROUP_STRIDE for b in remote],
            )
            continue
        assert len(local) == len(remote)
        assert all(b // _GROUP_STRIDE == (_DECODE_BASE // _GROUP_STRIDE + group_index)
                   for b in local)  # fmt: skip
        plan.pairs[group_index] = [
            (lb % _GROUP_STRIDE, rb % _GROUP_STRIDE)
            for lb, rb in zip(local, remote, strict=True)
        ]
    return plan


def transfer_plan(
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
    request_id = next_request_id()
    params = finish_prefill(
        model_dir, groups, dcp, request_id, num_prompt_tokens, prefill_tail_pages
    )
    consumer = connector(model_dir, groups, dcp, "kv_consumer")
    # The connector's own hooks (its fail-closed checks raise there; the
    # MoRIIOConnector hooks turn a refusal into a local-prefill fallback).
    scheduler = consumer.connector_scheduler
    assert scheduler is not None
    decode = make_request(request_id, num_prompt_tokens, params)
    reported, load_async = scheduler.get_num_new_matched_tokens(
        decode, local_hit_tokens
    )
    assert not load_async
    external = reported if final_external_tokens is None else final_external_tokens
    tables = decode_tables(groups, num_prompt_tokens + decode_tail_tokens, dcp)
    if short_local_group is not None:
        tables[short_local_group] = tables[short_local_group][:-1]
    scheduler.update_state_after_alloc(decode, make_kv_cache_blocks(tables), external)
    return read_plan(consumer, groups, request_id)


def missing_pages(num_prompt_tokens: int, hit_tokens: int, page: int) -> list[int]:
    """Pages holding a position in [hit, N-1): not held locally, computed by P."""
    end = num_prompt_tokens - 1
    if hit_tokens >= end:
        return []
    return list(range(hit_tokens // page, -(-end // page)))


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


def hashed_request(
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


@dataclass(frozen=True)
class TransferCase:
    """One transfer: the hybrid layout, the prompt, the decoder's local hit,
    and the run's options (``transfer_plan``'s keywords)."""

    groups: tuple[Group, ...]
    num_prompt_tokens: int
    hit_tokens: int
    dcp: int = 1
    final_external_tokens: int | None = None
    decode_tail_tokens: int = 1
    prefill_tail_pages: int = 0
    short_local_group: int | None = None
    lag_pages: int = 0  # how many pages a drafter's own hit lags the target's

    def plan(self, model_dir: Path) -> ReadPlan:
        return transfer_plan(
            model_dir,
            self.groups,
            dcp=self.dcp,
            num_prompt_tokens=self.num_prompt_tokens,
            local_hit_tokens=self.hit_tokens,
            final_external_tokens=self.final_external_tokens,
            decode_tail_tokens=self.decode_tail_tokens,
            prefill_tail_pages=self.prefill_tail_pages,
            short_local_group=self.short_local_group,
        )

    def missing(self, group_index: int, hit_tokens: int | None = None) -> list[int]:
        """The pages of the group that a hit of ``hit_tokens`` (default: the
        local hit) leaves missing."""
        hit = self.hit_tokens if hit_tokens is None else hit_tokens
        page = self.groups[group_index].page_tokens(self.dcp)
        return missing_pages(self.num_prompt_tokens, hit, page)


@st.composite
def transfer_cases(
    draw: st.DrawFn, with_drafter: bool, with_state: bool = True
) -> TransferCase:
    """Target groups (one spec) and KDA groups in any order; without state,
    MLA or Llama-like target groups and no KDA group; with a drafter, an
    EAGLE drafter group after the first target group (draft layers follow
    the model's), whose hit lags the target's by 0-2 pages."""
    dcp = draw(st.sampled_from([1, 2, 4, 8]))
    target = Group(
        draw(st.sampled_from(["target", "full"])) if not with_state else "target",
        draw(st.sampled_from([16, 32, 64, 128, 192, 256])),
        dcp_sharded=draw(st.booleans()),
    )
    groups = draw(
        st.permutations(
            [target] * draw(st.integers(1, 3))
            + [Group("kda")] * draw(st.integers(1, 2) if with_state else st.just(0))
        )
    )
    if with_drafter:
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
    return TransferCase(
        groups=tuple(groups),
        dcp=dcp,
        num_prompt_tokens=num_prompt_tokens,
        hit_tokens=page * draw(st.integers(0, (num_prompt_tokens - 2) // page)),
        lag_pages=draw(st.integers(0, 2)),
        decode_tail_tokens=draw(st.integers(1, 40)),
        prefill_tail_pages=draw(st.integers(0, 1)),
    )


def run_case(model_dir: Path, case: TransferCase) -> ReadPlan:
    """The transfer of ``case``; the target groups read only the pages the
    decoder lacks (whatever either leg's lookahead tail)."""
    plan = case.plan(model_dir)
    for index, group in enumerate(case.groups):
        if group.kind in ("target", "full"):
            assert plan.pages(index) == case.missing(index)
    return plan
