"""The harness of patch 0001's tests: a GLM-like hybrid layout built from
real vLLM spec classes, position-indexed block tables for both legs, the
producer -> consumer flow through the real scheduler-side connectors, and
the mori transfer engine stubbed at its boundary for the worker.

How the layout is built and why is in the docstring of
``test_0001_hybrid_multi_group.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import RequestStatus

from tests.patches.builders import (
    block_id_source,
    full_attention_spec,
    kda_mamba_spec,
    make_kv_cache_blocks,
    make_request,
    make_scheduler_connector,
    make_scheduler_output,
    mla_spec,
    sliding_window_spec,
)

B = 64  # MLA / indexer / KDA block size
TAIL_B = 8  # tail ring block size
TAIL_W = 8  # tail ring window
MTP = {"method": "mtp", "num_speculative_tokens": 1}
P_EXTRA_ROWS = 1  # prefiller lookahead rows past the (truncated) prompt
D_EXTRA_ROWS = 2  # decoder rows past the prompt (spec padding + lookahead)
UNRELATED_ZEROED_BLOCK = 999_999  # a block of some other request


# --------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------

MLA_LAYERS = ("layers.3.mla", "layers.3.indexer", "layers.7.mla", "layers.7.indexer")
MTP_LAYERS = ("mtp.0.mla", "mtp.0.indexer")
TAIL_LAYERS = ("layers.3.tail", "layers.7.tail", "mtp.0.tail")
KDA0_LAYERS = ("layers.0.kda", "layers.2.kda", "layers.5.kda")
KDA1_LAYERS = ("layers.1.kda", "layers.4.kda", "layers.6.kda")


def indexer_spec(is_draft: bool = False, **kw: Any) -> MLAAttentionSpec:
    """The kpool indexer: an MLA spec in the indexer cache role."""
    return MLAAttentionSpec(
        block_size=B,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=128,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
        is_draft=is_draft,
        **kw,
    )


def tail_spec(is_draft: bool = False) -> SlidingWindowMLASpec:
    return SlidingWindowMLASpec(
        block_size=TAIL_B,
        sliding_window=TAIL_W,
        bounded_replay=True,
        num_kv_heads=1,
        head_size=256,
        dtype=torch.bfloat16,
        dcp_sharded=False,
        is_draft=is_draft,
    )


def uniform(specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs:
    spec = UniformTypeKVCacheSpecs.from_specs(specs)
    assert spec is not None
    return spec


def glm_like_groups() -> list[KVCacheGroupSpec]:
    """[KDA0, MLA+indexer+MTP, KDA1, tail ring] (see module docstring)."""
    mla_specs: dict[str, KVCacheSpec] = {}
    for name in (*MLA_LAYERS, *MTP_LAYERS):
        draft = name.startswith("mtp.")
        mla_specs[name] = (
            indexer_spec(draft) if name.endswith("indexer") else mla_spec(B)
        )
    tail_specs: dict[str, KVCacheSpec] = {
        name: tail_spec(name.startswith("mtp.")) for name in TAIL_LAYERS
    }
    kda = kda_mamba_spec(block_size=B, num_speculative_blocks=1)
    return [
        KVCacheGroupSpec(list(KDA0_LAYERS), kda),
        KVCacheGroupSpec(list(mla_specs), uniform(mla_specs)),
        KVCacheGroupSpec(list(KDA1_LAYERS), kda),
        KVCacheGroupSpec(list(tail_specs), uniform(tail_specs)),
    ]


# transfer-group indices of the GLM-like layout, in payload order
GLM_ATTN = (1, 3)
GLM_MAMBA = (0, 2)
GLM_PAYLOAD = (*GLM_ATTN, *GLM_MAMBA)


def single_group_hybrid(attn: KVCacheSpec, num_mamba: int) -> list[KVCacheGroupSpec]:
    """One attention group ahead of ``num_mamba`` KDA/GDN groups."""
    mamba = kda_mamba_spec(block_size=attn.block_size)
    return [KVCacheGroupSpec(["attn.0", "attn.1"], attn)] + [
        KVCacheGroupSpec([f"mamba.{i}.0", f"mamba.{i}.1"], mamba)
        for i in range(num_mamba)
    ]


# --------------------------------------------------------------------------
# Position-indexed block tables
# --------------------------------------------------------------------------


@dataclass
class Leg:
    """One leg's tables (config group order) and each real block's page."""

    tables: list[list[int]]
    page_of: dict[int, int] = field(default_factory=dict)
    fresh: list[int] = field(default_factory=list)  # newly allocated blocks
    running_slot: dict[int, int] = field(default_factory=dict)  # Mamba group

    def page(self, block_id: int) -> int:
        return self.page_of[block_id]


def is_window(spec: KVCacheSpec) -> bool:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    return isinstance(spec, SlidingWindowSpec)


def build_leg(
    groups: Sequence[KVCacheGroupSpec],
    num_table_tokens: int,
    last_token: int,
    ids: Iterator[int],
    hit_pages: int = 0,
) -> Leg:
    """Tables for a leg holding ``num_table_tokens`` rows.

    ``last_token`` is the position the leg computes last (its window end);
    the first ``hit_pages`` pages of prefix-cacheable attention groups are
    local prefix-cache hits (not fresh).
    """
    leg = Leg(tables=[])
    for group in groups:
        spec = group.kv_cache_spec
        bs = spec.block_size
        num_pages = cdiv(num_table_tokens, bs)
        table: list[int] = []
        if isinstance(spec, MambaSpec):
            run = next(ids)
            scratch = [next(ids) for _ in range(spec.num_speculative_blocks)]
            table = [0] * (num_pages - 1) + [run, *scratch]
            leg.page_of[run] = num_pages - 1
            leg.running_slot[len(leg.tables)] = run
            leg.fresh += [run, *scratch]
        else:
            first_live = max(last_token - TAIL_W + 1, 0) // bs if is_window(spec) else 0
            for page in range(num_pages):
                if page < first_live:
                    table.append(0)
                    continue
                block = next(ids)
                table.append(block)
                leg.page_of[block] = page
                if not (spec.prefix_cacheable and page < hit_pages):
                    leg.fresh.append(block)
        leg.tables.append(table)
    return leg


def prefill_leg(groups: Sequence[KVCacheGroupSpec], n: int) -> Leg:
    return build_leg(groups, n - 1 + P_EXTRA_ROWS, n - 2, block_id_source(1))


def decode_leg(groups: Sequence[KVCacheGroupSpec], n: int, hit_pages: int = 0) -> Leg:
    return build_leg(
        groups, n + D_EXTRA_ROWS, n - 1, block_id_source(10_001), hit_pages
    )


# --------------------------------------------------------------------------
# Producer -> consumer flow through the real scheduler-side connectors
# --------------------------------------------------------------------------


@dataclass
class Transfer:
    params: dict[str, Any]
    p: Leg
    d: Leg
    local: list[list[int]]
    remote: list[list[int]]
    zero_before: list[int]
    zero_after: list[int]


def produce(p_conn: Any, groups: Sequence[KVCacheGroupSpec], n: int, rid: str):
    p = prefill_leg(groups, n)
    req = make_request(rid, n, {"do_remote_decode": True, "transfer_id": f"t-{rid}"})
    p_conn.on_new_request(req)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, params = p_conn.request_finished_all_groups(req, tuple(p.tables))
    assert delay_free and params is not None
    return p, params


def run_transfer(
    p_conn: Any,
    d_conn: Any,
    groups: Sequence[KVCacheGroupSpec],
    n: int,
    hit_pages: int,
) -> Transfer:
    rid = f"req-{n}-{hit_pages}"
    p, params = produce(p_conn, groups, n, rid)
    d = decode_leg(groups, n, hit_pages)
    req = make_request(f"{rid}-d", n, params)
    num_external, _ = d_conn.get_num_new_matched_tokens(req, hit_pages * B)
    assert num_external == n - 1 - hit_pages * B
    d_conn.update_state_after_alloc(req, make_kv_cache_blocks(d.tables), num_external)
    zero_before = [*d.fresh, UNRELATED_ZEROED_BLOCK]
    output = make_scheduler_output(zero_before)
    meta = d_conn.build_connector_meta(output)
    req_meta = meta.reqs_to_recv[req.request_id]
    return Transfer(
        params=params,
        p=p,
        d=d,
        local=[list(g) for g in req_meta.local_block_ids],
        remote=[list(g) for g in req_meta.remote_block_ids],
        zero_before=zero_before,
        zero_after=list(output.new_block_ids_to_zero or []),
    )


def assert_positional_pairs(t: Transfer, payload_index: int) -> list[tuple[int, int]]:
    """Every (decode, prefill) pair holds the same page; nulls pair with nulls."""
    local, remote = t.local[payload_index], t.remote[payload_index]
    assert len(local) <= len(remote)
    pairs = list(zip(local, remote[: len(local)], strict=True))
    for d_block, p_block in pairs:
        if d_block == 0 or p_block == 0:
            assert d_block == p_block == 0, (d_block, p_block)
            continue
        assert t.d.page(d_block) == t.p.page(p_block), (d_block, p_block)
    return pairs


def read_pages(t: Transfer, payload_index: int) -> set[int]:
    return {t.d.page(d) for d, _ in assert_positional_pairs(t, payload_index) if d}


def tail_pages_needed(n: int) -> set[int]:
    """Tail pages holding the decoder's window before its last token."""
    first = max(n - TAIL_W, 0)
    return set(range(first // TAIL_B, (n - 2) // TAIL_B + 1))


def attention_read_destinations(t: Transfer, num_attn: int) -> set[int]:
    return {b for group in t.local[:num_attn] for b in group if b}


def connector_pair(configs: tuple[Any, Any], kv_cache_config: KVCacheConfig):
    p_config, d_config = configs
    return (
        make_scheduler_connector(p_config, kv_cache_config),
        make_scheduler_connector(d_config, kv_cache_config),
    )


def wrapped_window_groups(wrapped: bool) -> list[KVCacheGroupSpec]:
    sw = {name: sliding_window_spec(16, 64) for name in ("sw.0", "sw.1")}
    sw_spec: KVCacheSpec = uniform(dict(sw)) if wrapped else sw["sw.0"]
    return [
        KVCacheGroupSpec(["full.0", "full.1"], full_attention_spec(16)),
        KVCacheGroupSpec(list(sw), sw_spec),
    ]


class FakeStatus:
    def Failed(self) -> bool:
        return False

    def Message(self) -> str:
        return ""


@dataclass(frozen=True)
class FakeSession:
    layer: str
    region: int


class FakeWrapper:
    """Stands in for MoRIIOWrapper: records every posted RDMA READ."""

    def __init__(self, **_: Any) -> None:
        self.lock = threading.Lock()
        self.reads: list[tuple[FakeSession, list[int], list[int]]] = []
        self.notify_port = 0

    def set_moriio_engine(self, engine: Any) -> None:
        self.engine = engine

    def set_backend_type(self, *_: Any, **__: Any) -> None:
        pass

    def read_remote_data(self, sizes, local_offsets, remote_offsets, session):
        self.reads.append((session, list(local_offsets), list(remote_offsets)))
        return FakeStatus()

    def send_notify(self, *_: Any, **__: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


def build_worker(vllm_config: Any, kv_cache_config: KVCacheConfig) -> Any:
    """The real worker __init__ on stubs; memory registration stubbed too."""
    worker = moriio_connector.MoRIIOConnectorWorker(
        vllm_config, "127.0.0.1:0", kv_cache_config
    )
    # What register_kv_caches would record: one region per attention layer,
    # two (conv, ssm) per KDA layer, one session per region.
    worker._has_mamba = True
    worker.layer_name_to_local_kv_cache_metadata = {}
    sessions: list[FakeSession] = []
    for group in kv_cache_config.kv_cache_groups:
        regions = 2 if isinstance(group.kv_cache_spec, MambaSpec) else 1
        for layer in group.layer_names:
            worker.layer_name_to_local_kv_cache_metadata[layer] = [b""] * regions
            sessions += [FakeSession(layer, r) for r in range(regions)]
    worker._get_built_session = lambda engine_id: (sessions, object())

    # Memory geometry stub: a block's byte offset is its id.
    def attention_offsets(layer, local, remote, *args, **kwargs):
        return list(local), list(remote[: len(local)]), [1] * len(local)

    def mamba_offsets(layer, local_slots, remote_slots, remote_tp_size=None):
        sizes = [1] * (2 * len(local_slots))
        return (
            [*local_slots, *local_slots],
            [*remote_slots, *remote_slots],
            sizes,
            len(local_slots),
        )

    worker._compute_read_attention_offsets = attention_offsets
    worker._compute_mamba_transfer_offsets = mamba_offsets
    return worker


def base_single_group_payload(groups, tables) -> list[list[int]]:
    """The base's hybrid READ layout, computed from the tables: the attention
    group as allocated, then each Mamba group's running-state slot."""
    spec_blocks = groups[1].kv_cache_spec.num_speculative_blocks
    attn = list(tables[0])
    mamba = [list(table[: len(table) - spec_blocks][-1:]) for table in tables[1:]]
    return [attn, *mamba]
