"""Patch 0001: MoRIIO hybrid READ for several attention groups (upstream #60867).

The GLM-5.3-Flash-like layout is built BY HAND from real vLLM spec classes,
not through vLLM's planner. On the pinned vLLM 0.33.0 the real GLM5-next
grouping (``get_kv_cache_groups``) gives the kpool tail ring a
``CircularBufferSpec`` and, under block-outermost layouts, wraps the KDA groups
in ``UniformTypeKVCacheSpecs``; #60867's design covers neither (it describes
the tail as a non-prefix-cacheable sliding-window spec and bare KDA
``MambaSpec`` groups). The hand-built layout follows #60867's description:

- MLA + kpool indexer (+ the MTP layer): ``UniformTypeKVCacheSpecs.from_specs``
  over ``MLAAttentionSpec`` layers, block 64, prefix-cacheable;
- the tail ring: ``UniformTypeKVCacheSpecs.from_specs`` over
  ``SlidingWindowMLASpec(bounded_replay=True)`` layers (a sliding-window spec
  that is not prefix-cacheable), block 8, window 8;
- two KDA groups: ``MambaSpec`` with two states, one speculative scratch slot;
- KDA groups ahead of the attention groups in transfer-group order, as vLLM's
  packed grouping emits them, so the payload order is exercised.

Block tables are position-indexed lists built by the tests: a leg holding T
tokens has ``cdiv(T, block)`` pages; sliding-window pages before the window of
the leg's last token are the null block 0; a Mamba table's running-state slot
is followed by its scratch slot. The prefiller holds N-1 prompt tokens plus
one MTP lookahead row, the decoder N tokens plus two rows; prompt lengths are
chosen where both legs hold the same number of pages.
"""

from __future__ import annotations

import json
import threading
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from tests.patches.conftest import (
    block_id_source,
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
    sliding_window_spec,
)
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common,
    moriio_connector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    MoRIIOError,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)
from vllm.v1.request import RequestStatus

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


def _indexer_spec(is_draft: bool = False) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=B,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=128,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
        is_draft=is_draft,
    )


def _tail_spec(is_draft: bool = False) -> SlidingWindowMLASpec:
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


def _uniform(specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs:
    spec = UniformTypeKVCacheSpecs.from_specs(specs)
    assert spec is not None
    return spec


def glm_like_groups() -> list[KVCacheGroupSpec]:
    """[KDA0, MLA+indexer+MTP, KDA1, tail ring] (see module docstring)."""
    mla_specs: dict[str, KVCacheSpec] = {}
    for name in (*MLA_LAYERS, *MTP_LAYERS):
        draft = name.startswith("mtp.")
        mla_specs[name] = (
            _indexer_spec(draft) if name.endswith("indexer") else mla_spec(B)
        )
    tail_specs: dict[str, KVCacheSpec] = {
        name: _tail_spec(name.startswith("mtp.")) for name in TAIL_LAYERS
    }
    kda = kda_mamba_spec(block_size=B, num_speculative_blocks=1)
    return [
        KVCacheGroupSpec(list(KDA0_LAYERS), kda),
        KVCacheGroupSpec(list(mla_specs), _uniform(mla_specs)),
        KVCacheGroupSpec(list(KDA1_LAYERS), kda),
        KVCacheGroupSpec(list(tail_specs), _uniform(tail_specs)),
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


def _is_window(spec: KVCacheSpec) -> bool:
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
            first_live = (
                max(last_token - TAIL_W + 1, 0) // bs if _is_window(spec) else 0
            )
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


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_vllm_configs(deepseek_mtp_model_dir: Path):
    return (
        make_vllm_config(
            deepseek_mtp_model_dir,
            moriio_kv_transfer_config("kv_producer"),
            block_size=B,
            speculative_config=MTP,
        ),
        make_vllm_config(
            deepseek_mtp_model_dir,
            moriio_kv_transfer_config("kv_consumer"),
            block_size=B,
            speculative_config=MTP,
        ),
    )


@pytest.fixture(scope="module")
def plain_vllm_configs(llama_model_dir: Path):
    return (
        make_vllm_config(llama_model_dir, moriio_kv_transfer_config("kv_producer")),
        make_vllm_config(llama_model_dir, moriio_kv_transfer_config("kv_consumer")),
    )


def _pair(configs: tuple[Any, Any], kv_cache_config: KVCacheConfig):
    p_config, d_config = configs
    return (
        make_scheduler_connector(p_config, kv_cache_config),
        make_scheduler_connector(d_config, kv_cache_config),
    )


# --------------------------------------------------------------------------
# New behaviour (fails on the base)
# --------------------------------------------------------------------------

PROMPT_LENGTHS = (193, 449)  # N - 1 a multiple of B: a full local hit exists


def test_scheduler_accepts_glm_groups_with_mtp(mtp_vllm_configs) -> None:
    groups = glm_like_groups()
    p_conn, d_conn = _pair(mtp_vllm_configs, make_kv_cache_config(groups))
    for conn in (p_conn, d_conn):
        sched = conn.connector_scheduler
        assert list(sched._attn_group_ids) == list(GLM_ATTN)
        assert list(sched._mamba_group_ids) == list(GLM_MAMBA)

    n = PROMPT_LENGTHS[0]
    p, params = produce(p_conn, groups, n, "accept")
    payload = params["remote_block_ids"]
    assert len(payload) == len(GLM_PAYLOAD)
    mla_payload, tail_payload, kda0_payload, kda1_payload = payload
    # MLA/indexer: the prompt's pages, in order, from page 0.
    mla_table = p.tables[GLM_ATTN[0]]
    assert mla_payload == mla_table[: len(mla_payload)]
    assert len(mla_payload) >= cdiv(n - 1, B)
    # Tail ring: clipped to its window, cdiv(W, block) + 1 pages, holding the
    # window of the prefiller's last prompt token.
    tail_table = p.tables[GLM_ATTN[1]]
    assert len(tail_payload) == cdiv(TAIL_W, TAIL_B) + 1
    assert any(
        tail_table[start : start + len(tail_payload)] == tail_payload
        for start in range(len(tail_table))
    )
    window_pages = range((n - 1 - TAIL_W) // TAIL_B, (n - 2) // TAIL_B + 1)
    assert set(window_pages) <= {p.page(b) for b in tail_payload if b}
    # KDA: the running-state slot only; the one MTP scratch slot stays local.
    for kda_payload, group_id in ((kda0_payload, 0), (kda1_payload, 2)):
        assert kda_payload == [p.running_slot[group_id]]


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_glm_mtp_read_pairs_every_group_on_partial_hit(mtp_vllm_configs, n) -> None:
    groups = glm_like_groups()
    p_conn, d_conn = _pair(mtp_vllm_configs, make_kv_cache_config(groups))
    hit_pages = (n - 1) // B - 1
    t = run_transfer(p_conn, d_conn, groups, n, hit_pages)

    assert len(t.local) == len(t.remote) == len(GLM_PAYLOAD)
    # MLA/indexer: every prompt page the decoder misses is read in place.
    assert set(range(hit_pages, cdiv(n - 1, B))) <= read_pages(t, 0)
    # Tail ring: the decoder's window pages are read in place.
    assert tail_pages_needed(n) <= read_pages(t, 1)
    # KDA: running-state slot to running-state slot, per group.
    for payload_index, group_id in ((2, GLM_MAMBA[0]), (3, GLM_MAMBA[1])):
        assert t.local[payload_index] == [t.d.running_slot[group_id]]
        assert t.remote[payload_index] == [t.p.running_slot[group_id]]
    # Zeroing: attention READ destinations are kept out; the rest stays.
    read_dst = attention_read_destinations(t, len(GLM_ATTN))
    assert read_dst
    assert sorted(t.zero_after) == sorted(set(t.zero_before) - read_dst)
    for group_id in GLM_MAMBA:  # running-state and scratch slots
        assert set(t.d.tables[group_id][-2:]) <= set(t.zero_after)
    assert UNRELATED_ZEROED_BLOCK in t.zero_after


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_glm_mtp_full_local_hit_reads_only_tail_and_kda(mtp_vllm_configs, n) -> None:
    groups = glm_like_groups()
    p_conn, d_conn = _pair(mtp_vllm_configs, make_kv_cache_config(groups))
    t = run_transfer(p_conn, d_conn, groups, n, hit_pages=(n - 1) // B)

    assert len(t.local) == len(t.remote) == len(GLM_PAYLOAD)
    assert t.local[0] == []  # MLA/indexer: a prefix-cacheable full hit
    assert tail_pages_needed(n) <= read_pages(t, 1)
    for payload_index, group_id in ((2, GLM_MAMBA[0]), (3, GLM_MAMBA[1])):
        assert t.local[payload_index] == [t.d.running_slot[group_id]]
        assert t.remote[payload_index] == [t.p.running_slot[group_id]]
    tail_dst = {b for b in t.local[1] if b}
    assert tail_dst and not tail_dst & set(t.zero_after)
    assert sorted(t.zero_after) == sorted(set(t.zero_before) - tail_dst)


def test_group_count_mismatch_fails_closed(mtp_vllm_configs) -> None:
    groups = glm_like_groups()
    _, d_conn = _pair(mtp_vllm_configs, make_kv_cache_config(groups))
    n = PROMPT_LENGTHS[0]
    p = prefill_leg(groups, n)
    # A prefiller with one attention group fewer: [MLA, KDA0, KDA1].
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "127.0.0.1:1",
        "transfer_id": "t-mismatch",
        "remote_block_ids": [
            p.tables[1],
            [p.running_slot[0]],
            [p.running_slot[2]],
        ],
    }
    d = decode_leg(groups, n, hit_pages=1)
    for num_external in (n - 1 - B, 0):
        req = make_request(f"mismatch-{num_external}", n, params)
        with pytest.raises(MoRIIOError, match="count mismatch"):
            d_conn.update_state_after_alloc(
                req, make_kv_cache_blocks(d.tables), num_external
            )


@pytest.mark.parametrize(
    "attn",
    [
        pytest.param(mla_spec(B), id="mla"),
        pytest.param(full_attention_spec(B), id="gqa"),
    ],
)
def test_single_group_hybrid_accepts_mtp(mtp_vllm_configs, attn) -> None:
    groups = single_group_hybrid(attn, num_mamba=2)
    p_conn, d_conn = _pair(mtp_vllm_configs, make_kv_cache_config(groups))
    n = 100
    t = run_transfer(p_conn, d_conn, groups, n, hit_pages=0)
    assert set(range(cdiv(n - 1, B))) <= read_pages(t, 0)
    assert t.local[1:] == [[t.d.running_slot[g]] for g in (1, 2)]
    assert t.remote[1:] == [[t.p.running_slot[g]] for g in (1, 2)]


def _wrapped_window_groups(wrapped: bool) -> list[KVCacheGroupSpec]:
    sw = {name: sliding_window_spec(16, 64) for name in ("sw.0", "sw.1")}
    sw_spec: KVCacheSpec = _uniform(dict(sw)) if wrapped else sw["sw.0"]
    return [
        KVCacheGroupSpec(["full.0", "full.1"], full_attention_spec(16)),
        KVCacheGroupSpec(list(sw), sw_spec),
    ]


def test_read_accepts_wrapped_sliding_window_like_bare(plain_vllm_configs) -> None:
    """A UniformTypeKVCacheSpecs over one window is clipped like the bare spec."""
    tables = ([1, 2, 3, 4, 5, 6], [0, 0, 0, 14, 15, 16])
    payloads = []
    for wrapped in (False, True):
        groups = _wrapped_window_groups(wrapped)
        p_conn, _ = _pair(plain_vllm_configs, make_kv_cache_config(groups))
        req = make_request(
            f"sw-{wrapped}", 96, {"do_remote_decode": True, "transfer_id": "t"}
        )
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = p_conn.request_finished_all_groups(req, tables)
        payloads.append(params["remote_block_ids"])
    assert payloads[1] == payloads[0]
    assert len(payloads[1][1]) == cdiv(64, 16) + 1


# --------------------------------------------------------------------------
# Worker routing, with the mori transfer engine stubbed at its boundary
# --------------------------------------------------------------------------


class _FakeStatus:
    def Failed(self) -> bool:
        return False

    def Message(self) -> str:
        return ""


@dataclass(frozen=True)
class _FakeSession:
    layer: str
    region: int


class _FakeWrapper:
    """Stands in for MoRIIOWrapper: records every posted RDMA READ."""

    def __init__(self, **_: Any) -> None:
        self.lock = threading.Lock()
        self.reads: list[tuple[_FakeSession, list[int], list[int]]] = []
        self.notify_port = 0

    def set_moriio_engine(self, engine: Any) -> None:
        self.engine = engine

    def set_backend_type(self, *_: Any, **__: Any) -> None:
        pass

    def read_remote_data(self, sizes, local_offsets, remote_offsets, session):
        self.reads.append((session, list(local_offsets), list(remote_offsets)))
        return _FakeStatus()

    def send_notify(self, *_: Any, **__: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


@pytest.fixture
def stub_mori(monkeypatch: pytest.MonkeyPatch) -> None:
    mc = moriio_connector
    monkeypatch.setattr(mc, "MoRIIO_enabled", True)
    monkeypatch.setattr(mc, "IOEngine", lambda *a, **k: object(), raising=False)
    monkeypatch.setattr(mc, "IOEngineConfig", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(
        mc,
        "BackendType",
        types.SimpleNamespace(XGMI="xgmi", RDMA="rdma"),
        raising=False,
    )
    monkeypatch.setattr(mc, "MoRIIOWrapper", _FakeWrapper)
    monkeypatch.setattr(
        mc, "get_world_group", lambda: types.SimpleNamespace(rank=0, local_rank=0)
    )
    monkeypatch.setattr(mc, "get_tp_group", lambda: None)
    monkeypatch.setattr(mc, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(moriio_common, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(
        moriio_common, "get_tensor_model_parallel_world_size", lambda: 1
    )
    monkeypatch.setattr(
        mc,
        "get_attn_backend",
        lambda *a, **k: types.SimpleNamespace(get_name=lambda: "STUB"),
    )
    monkeypatch.setattr(mc.MoRIIOConnectorWorker, "_start_heartbeat", lambda self: None)


def _build_worker(vllm_config: Any, kv_cache_config: KVCacheConfig) -> Any:
    """The real worker __init__ on stubs; memory registration stubbed too."""
    worker = moriio_connector.MoRIIOConnectorWorker(
        vllm_config, "127.0.0.1:0", kv_cache_config
    )
    # What register_kv_caches would record: one region per attention layer,
    # two (conv, ssm) per KDA layer, one session per region.
    worker._has_mamba = True
    worker.layer_name_to_local_kv_cache_metadata = {}
    sessions: list[_FakeSession] = []
    for group in kv_cache_config.kv_cache_groups:
        regions = 2 if isinstance(group.kv_cache_spec, MambaSpec) else 1
        for layer in group.layer_names:
            worker.layer_name_to_local_kv_cache_metadata[layer] = [b""] * regions
            sessions += [_FakeSession(layer, r) for r in range(regions)]
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


def test_read_blocks_routes_each_hybrid_layer_to_its_group(
    stub_mori, mtp_vllm_configs
) -> None:
    groups = glm_like_groups()
    kv_cache_config = make_kv_cache_config(groups)
    worker = _build_worker(mtp_vllm_configs[1], kv_cache_config)
    try:
        local = [[101, 102], [201, 202], [301], [401]]
        remote = [[111, 112], [211, 212], [311], [411]]
        worker._read_blocks(
            local_block_ids=local,
            remote_block_ids=remote,
            dst_engine_id="127.0.0.1:1",
            request_id="route",
            transfer_id="t-route",
            remote_host="127.0.0.1",
            remote_notify_port=1,
            remote_tp_size=1,
        )
        reads = worker.moriio_wrapper.reads
    finally:
        worker.shutdown()

    by_layer: dict[str, list[tuple[int, list[int], list[int]]]] = {}
    for session, local_offs, remote_offs in reads:
        by_layer.setdefault(session.layer, []).append(
            (session.region, local_offs, remote_offs)
        )
    expected_payload = {
        **{layer: 0 for layer in (*MLA_LAYERS, *MTP_LAYERS)},
        **{layer: 1 for layer in TAIL_LAYERS},
        **{layer: 2 for layer in KDA0_LAYERS},
        **{layer: 3 for layer in KDA1_LAYERS},
    }
    assert set(by_layer) == set(expected_payload)
    for layer, index in expected_payload.items():
        posted = by_layer[layer]
        if index >= 2:  # KDA: conv then ssm region, the group's slot each
            assert [region for region, _, _ in posted] == [0, 1]
        else:
            assert [region for region, _, _ in posted] == [0]
        for _, local_offs, remote_offs in posted:
            assert local_offs == local[index], layer
            assert remote_offs == remote[index], layer


# --------------------------------------------------------------------------
# Back-compat (passes on the base too; not in the patch's Tests header)
# --------------------------------------------------------------------------


def _base_single_group_payload(groups, tables) -> list[list[int]]:
    """The base's hybrid READ layout, computed from the tables: the attention
    group as allocated, then each Mamba group's running-state slot."""
    spec_blocks = groups[1].kv_cache_spec.num_speculative_blocks
    attn = list(tables[0])
    mamba = [list(table[: len(table) - spec_blocks][-1:]) for table in tables[1:]]
    return [attn, *mamba]


SINGLE_GROUP_LAYOUTS = [
    pytest.param(mla_spec(B), 2, id="kimi-k3-like-mla-kda"),
    pytest.param(full_attention_spec(B), 3, id="qwen3.5-like-gqa-gdn"),
]


@pytest.mark.parametrize(("attn", "num_mamba"), SINGLE_GROUP_LAYOUTS)
def test_single_attention_group_payload_is_byte_identical_to_base(
    plain_vllm_configs, attn, num_mamba
) -> None:
    groups = single_group_hybrid(attn, num_mamba)
    p_conn, _ = _pair(plain_vllm_configs, make_kv_cache_config(groups))
    n = 100  # the prefiller's rows fit its prompt pages
    p, params = produce(p_conn, groups, n, f"bytes-{num_mamba}")
    expected = dict(params)
    expected["remote_block_ids"] = _base_single_group_payload(groups, p.tables)
    assert msgspec.msgpack.encode(params) == msgspec.msgpack.encode(expected)
    assert json.dumps(params) == json.dumps(expected)


@pytest.mark.parametrize(("attn", "num_mamba"), SINGLE_GROUP_LAYOUTS)
def test_single_attention_group_read_unchanged(
    plain_vllm_configs, attn, num_mamba
) -> None:
    groups = single_group_hybrid(attn, num_mamba)
    p_conn, d_conn = _pair(plain_vllm_configs, make_kv_cache_config(groups))
    n = 2 * B + 36
    partial = run_transfer(p_conn, d_conn, groups, n, hit_pages=1)
    assert set(range(1, cdiv(n - 1, B))) <= read_pages(partial, 0)
    mamba_ids = range(1, num_mamba + 1)
    assert partial.local[1:] == [[partial.d.running_slot[g]] for g in mamba_ids]
    assert partial.remote[1:] == [[partial.p.running_slot[g]] for g in mamba_ids]
    assert not attention_read_destinations(partial, 1) & set(partial.zero_after)

    n = 2 * B + 1
    full = run_transfer(p_conn, d_conn, groups, n, hit_pages=2)
    assert full.local[0] == []
    assert full.local[1:] == [[full.d.running_slot[g]] for g in mamba_ids]


def test_single_full_attention_payload_is_byte_identical_to_base(
    plain_vllm_configs,
) -> None:
    """Non-hybrid: the payload is the transfer group's table as allocated."""
    groups = [KVCacheGroupSpec(["attn.0", "attn.1"], full_attention_spec(16))]
    p_conn, _ = _pair(plain_vllm_configs, make_kv_cache_config(groups))
    table = [7, 3, 9, 4]
    req = make_request("plain", 60, {"do_remote_decode": True, "transfer_id": "t"})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p_conn.request_finished_all_groups(req, (table,))
    expected = dict(params)
    expected["remote_block_ids"] = [table]
    assert msgspec.msgpack.encode(params) == msgspec.msgpack.encode(expected)


def test_hybrid_without_attention_group_is_rejected(plain_vllm_configs) -> None:
    groups = [KVCacheGroupSpec(["kda.0"], kda_mamba_spec(block_size=B))]
    with pytest.raises(MoRIIOError, match="requires an attention group"):
        _pair(plain_vllm_configs, make_kv_cache_config(groups))


def test_wrapped_mamba_group_is_still_rejected(plain_vllm_configs) -> None:
    kda = {name: kda_mamba_spec(block_size=B) for name in ("kda.0", "kda.1")}
    groups = [
        KVCacheGroupSpec(["attn.0"], full_attention_spec(B)),
        KVCacheGroupSpec(list(kda), _uniform(dict(kda))),
    ]
    with pytest.raises(NotImplementedError, match="UniformTypeKVCacheSpecs"):
        _pair(plain_vllm_configs, make_kv_cache_config(groups))


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "wrapped"])
def test_write_mode_still_rejects_sliding_window(llama_model_dir, wrapped) -> None:
    config = make_vllm_config(
        llama_model_dir, moriio_kv_transfer_config("kv_producer", read_mode=False)
    )
    with pytest.raises(NotImplementedError):
        make_scheduler_connector(
            config, make_kv_cache_config(_wrapped_window_groups(wrapped))
        )


def _glm5_next_layer_specs() -> dict[str, KVCacheSpec]:
    """Per-layer specs shaped like 0.33.0's GLM5-next caches: MLA, the kpool
    indexer (``tokens_per_state``), the ``CircularBufferSpec`` tail ring, KDA."""
    specs: dict[str, KVCacheSpec] = {}
    for i in ("0", "1", "2", "4", "5", "6"):
        specs[f"layers.{i}.kda"] = kda_mamba_spec(
            block_size=B, num_speculative_blocks=1, shapes=((3, 513), (4, 64, 64))
        )
    for i in ("3", "7", "mtp"):
        draft = i == "mtp"
        specs[f"layers.{i}.mla"] = mla_spec(B, is_draft=draft)
        specs[f"layers.{i}.indexer"] = MLAAttentionSpec(
            block_size=B,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=128,
            dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER,
            tokens_per_state=4,
            is_draft=draft,
        )
        specs[f"layers.{i}.tail"] = CircularBufferSpec(
            block_size=8,
            num_kv_heads=2,
            head_size=128,
            head_size_v=0,
            dtype=torch.bfloat16,
            dcp_sharded=False,
            is_draft=draft,
        )
    return specs


@pytest.mark.parametrize("layout", ["BLNHC", "LBNHC"])
def test_pinned_glm5_next_grouping_fails_closed(mtp_vllm_configs, layout) -> None:
    """vLLM 0.33.0's own grouping of GLM5-next-shaped caches yields a
    CircularBufferSpec tail ring, which neither the base nor #60867 transfers:
    the connector must refuse it at startup rather than move wrong blocks."""
    p_config, d_config = mtp_vllm_configs
    previous = p_config.cache_config.kv_cache_layout
    p_config.cache_config.kv_cache_layout = layout
    try:
        groups = get_kv_cache_groups(p_config, _glm5_next_layer_specs())
    finally:
        p_config.cache_config.kv_cache_layout = previous
    assert any(
        isinstance(spec, CircularBufferSpec)
        for group in groups
        for spec in iter_layer_specs(group.kv_cache_spec)
    )
    with pytest.raises((MoRIIOError, NotImplementedError)):
        make_scheduler_connector(d_config, make_kv_cache_config(groups))


def test_write_mode_hybrid_still_rejects_mtp(deepseek_mtp_model_dir) -> None:
    config = make_vllm_config(
        deepseek_mtp_model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        block_size=B,
        speculative_config=MTP,
    )
    groups = single_group_hybrid(mla_spec(B), num_mamba=1)
    with pytest.raises(MoRIIOError, match="DSpark"):
        make_scheduler_connector(config, make_kv_cache_config(groups))
