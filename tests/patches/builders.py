"""Shared builders for the per-patch tests, against the real vLLM classes.

Everything here builds offline on CPU: a ``VllmConfig`` from a local folder
that holds only ``config.json``, a MoRIIO ``KVTransferConfig``, a
``KVCacheConfig`` from spec objects, the real scheduler-side
``MoRIIOConnector`` and the ``Request`` / ``KVCacheBlocks`` /
``SchedulerOutput`` objects its hooks take.

Below them, by section: the hybrid READ harness, the READ and WRITE legs
each on a real ``Scheduler``, the block pairing judge, the prefix-hit
driver. Every patch's tests import their builders from here (``conftest.py``
beside it holds only the fixtures); export inlines what a port needs.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import json
import logging
import math
import mmap
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
import torch
from hypothesis import strategies as st
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common,
    moriio_connector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector import (
    MoRIIOConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_planning import get_kv_cache_configs, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    resolve_dcp_kv_block_size,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
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
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.utils import allocate_kv_cache

from tests.patches.vllm_unit_utils import create_scheduler

# --------------------------------------------------------------------------
# Model folders (config.json only)
# --------------------------------------------------------------------------

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}

# DeepSeek-V3-like MLA model with one MTP layer, enough for
# SpeculativeConfig(method="mtp") to resolve offline.
TINY_DEEPSEEK_MTP_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "num_nextn_predict_layers": 1,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def write_model_dir(directory: Path, config: Mapping[str, Any]) -> Path:
    """Write ``config.json`` into ``directory`` and return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(config)))
    return directory


# --------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------

_port_counter = itertools.count()


def moriio_kv_transfer_config(
    kv_role: str = "kv_consumer",
    *,
    read_mode: bool = True,
    port_base: int | None = None,
    **extra: Any,
) -> KVTransferConfig:
    """A MoRIIO ``KVTransferConfig``; READ mode unless ``read_mode=False``.

    Each call gets its own handshake/notify ports so two legs built in one
    process never share them. ``host_ip`` is pinned to loopback so building
    the scheduler never probes an outside address.
    """
    base = port_base if port_base is not None else 20000 + 10 * next(_port_counter)
    extra_config: dict[str, Any] = {
        "handshake_port": base,
        "notify_port": base + 1,
        "proxy_ip": "127.0.0.1",
        "http_port": base + 2,
        "host_ip": "127.0.0.1",
        "read_mode": read_mode,
    }
    extra_config.update(extra)
    return KVTransferConfig(
        kv_connector="MoRIIOConnector",
        kv_role=kv_role,
        kv_connector_extra_config=extra_config,
    )


def make_vllm_config(
    model_dir: Path,
    kv_transfer_config: KVTransferConfig,
    *,
    block_size: int = 16,
    speculative_config: Mapping[str, Any] | None = None,
    disable_hybrid_kv_cache_manager: bool = False,
    enable_prefix_caching: bool = True,
) -> VllmConfig:
    """A ``VllmConfig`` built offline from a folder holding only config.json.

    ``speculative_config`` is a dict such as ``{"method": "mtp",
    "num_speculative_tokens": 1}``; it is resolved into a real
    ``SpeculativeConfig`` against the target model.
    """
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True)
    cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=enable_prefix_caching
    )
    scheduler_config = SchedulerConfig.default_factory(
        max_model_len=model_config.max_model_len,
        is_encoder_decoder=model_config.is_encoder_decoder,
    )
    scheduler_config.disable_hybrid_kv_cache_manager = disable_hybrid_kv_cache_manager
    spec = None
    if speculative_config is not None:
        spec = SpeculativeConfig(
            target_model_config=model_config,
            target_parallel_config=VllmConfig().parallel_config,
            **dict(speculative_config),
        )
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        kv_transfer_config=kv_transfer_config,
        speculative_config=spec,
    )


# --------------------------------------------------------------------------
# KV cache specs and configs
# --------------------------------------------------------------------------


def full_attention_spec(block_size: int = 16, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=kw.pop("num_kv_heads", 2),
        head_size=kw.pop("head_size", 64),
        dtype=kw.pop("dtype", torch.bfloat16),
        **kw,
    )


def mla_spec(block_size: int = 64, **kw: Any) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=kw.pop("head_size", 576),
        dtype=kw.pop("dtype", torch.bfloat16),
        **kw,
    )


def sliding_window_spec(
    block_size: int = 16, sliding_window: int = 128, **kw: Any
) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=kw.pop("num_kv_heads", 2),
        head_size=kw.pop("head_size", 64),
        dtype=kw.pop("dtype", torch.bfloat16),
        sliding_window=sliding_window,
        **kw,
    )


def kda_mamba_spec(
    block_size: int = 64,
    num_speculative_blocks: int = 0,
    mamba_cache_mode: str = "align",
    **kw: Any,
) -> MambaSpec:
    """A KDA-like ``MambaSpec``: two states (conv, ssm)."""
    return MambaSpec(
        block_size=block_size,
        shapes=kw.pop("shapes", ((3, 512), (4, 64, 64))),
        dtypes=kw.pop("dtypes", (torch.bfloat16, torch.float32)),
        mamba_cache_mode=mamba_cache_mode,
        num_speculative_blocks=num_speculative_blocks,
        **kw,
    )


def page_kda_spec(block_size: int, num_speculative_blocks: int = 0) -> MambaSpec:
    """A small KDA state padded to one full-attention page of ``block_size``
    tokens (two KV heads of 64, bf16): every state fits in it."""
    return kda_mamba_spec(
        block_size=block_size,
        shapes=((128, 3), (2, 32, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=full_attention_spec(block_size).page_size_bytes,
        num_speculative_blocks=num_speculative_blocks,
    )


GroupLike = KVCacheGroupSpec | tuple[Sequence[str], KVCacheSpec]


def make_kv_cache_config(
    groups: Sequence[GroupLike], num_blocks: int = 4096
) -> KVCacheConfig:
    """A ``KVCacheConfig`` with the given groups and no tensors.

    ``groups`` holds ``KVCacheGroupSpec`` objects or ``(layer_names, spec)``
    pairs. The scheduler side never reads ``kv_cache_tensors``.
    """
    kv_cache_groups = [
        g if isinstance(g, KVCacheGroupSpec) else KVCacheGroupSpec(list(g[0]), g[1])
        for g in groups
    ]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups
    )


def chunked_local_spec(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    """A chunked local attention spec: a token attends to the positions of
    its own ``chunk``-token chunk."""
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        attention_chunk_size=chunk,
    )


# --------------------------------------------------------------------------
# The real scheduler-side connector
# --------------------------------------------------------------------------


def make_scheduler_connector(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> MoRIIOConnector:
    """The real ``MoRIIOConnector`` in the SCHEDULER role."""
    with set_current_vllm_config(vllm_config):
        return MoRIIOConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def make_leg_connector(
    model_dir: Path,
    role: str,
    groups: Sequence[GroupLike],
    *,
    read_mode: bool = True,
    dcp: int = 1,
) -> MoRIIOConnector:
    """The real scheduler-side ``MoRIIOConnector`` of one leg in ``role``
    (READ mode unless ``read_mode=False``, decode context parallel size
    ``dcp``) holding ``groups``."""
    vllm_config = make_vllm_config(
        model_dir, moriio_kv_transfer_config(role, read_mode=read_mode)
    )
    vllm_config.parallel_config.decode_context_parallel_size = dcp
    return make_scheduler_connector(vllm_config, make_kv_cache_config(groups))


# --------------------------------------------------------------------------
# Requests, blocks, scheduler outputs
# --------------------------------------------------------------------------


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    *,
    status: RequestStatus | None = None,
) -> Request:
    """A real ``Request`` with its own prompt list and a deep copy of params."""
    params = copy.deepcopy(dict(kv_transfer_params)) if kv_transfer_params else None
    sampling = SamplingParams(
        max_tokens=1,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params is not None else None,
    )
    request = Request(
        request_id=request_id,
        prompt_token_ids=[(i % 997) + 1 for i in range(num_prompt_tokens)],
        sampling_params=sampling,
        pooling_params=None,
    )
    if status is not None:
        request.status = status
    return request


def make_kv_cache_blocks(block_ids: Sequence[Sequence[int]]) -> KVCacheBlocks:
    """Real ``KVCacheBlocks`` whose ``get_block_ids()`` is ``block_ids``."""
    return KVCacheBlocks(
        tuple([KVCacheBlock(block_id=b) for b in group] for group in block_ids)
    )


def make_scheduler_output(
    new_block_ids_to_zero: Sequence[int] | None = None,
) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    output.new_block_ids_to_zero = (
        list(new_block_ids_to_zero) if new_block_ids_to_zero is not None else None
    )
    return output


def block_id_source(start: int = 1) -> Iterator[int]:
    """Distinct block ids, never 0 (vLLM's null block)."""
    return itertools.count(start)


# ==========================================================================
# Hybrid READ harness: a GLM-like layout, both legs' tables, stubbed engine
# ==========================================================================
#
# A GLM-like hybrid layout built from
# real vLLM spec classes, position-indexed block tables for both legs, the
# producer -> consumer flow through the real scheduler-side connectors, and
# the mori transfer engine stubbed at its boundary for the worker.


class WarningRecords(logging.Handler):
    """Keeps every WARNING (and above) record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class DoneStatus:
    """A mori transfer status that reports success at once."""

    def Succeeded(self) -> bool:
        return True

    def Failed(self) -> bool:
        return False

    def InProgress(self) -> bool:
        return False

    def Code(self) -> int:
        return 0

    def Message(self) -> str:
        return ""


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


def glm_transfer(configs: tuple[Any, Any], n: int, hit_pages: int) -> Transfer:
    """One READ of ``n`` tokens between real GLM-like scheduler connectors,
    the decoder holding ``hit_pages`` pages; one list per payload group."""
    groups = glm_like_groups()
    p_conn, d_conn = connector_pair(configs, make_kv_cache_config(groups))
    t = run_transfer(p_conn, d_conn, groups, n, hit_pages)
    assert len(t.local) == len(t.remote) == len(GLM_PAYLOAD)
    return t


def wrapped_window_groups(wrapped: bool) -> list[KVCacheGroupSpec]:
    sw = {name: sliding_window_spec(16, 64) for name in ("sw.0", "sw.1")}
    sw_spec: KVCacheSpec = uniform(dict(sw)) if wrapped else sw["sw.0"]
    return [
        KVCacheGroupSpec(["full.0", "full.1"], full_attention_spec(16)),
        KVCacheGroupSpec(list(sw), sw_spec),
    ]


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
        return DoneStatus()

    def send_notify(self, *_: Any, **__: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


def read_blocks(
    worker: Any,
    local: list[list[int]],
    remote: list[list[int]],
    transfer_id: str = "t-read",
) -> list[tuple[FakeSession, list[int], list[int]]]:
    """Post one READ of ``remote`` into ``local`` (one list per payload
    slot) from a loopback prefiller; the RDMA READs the wrapper recorded."""
    worker._read_blocks(
        local_block_ids=local,
        remote_block_ids=remote,
        dst_engine_id="127.0.0.1:1",
        request_id=transfer_id.removeprefix("t-"),
        transfer_id=transfer_id,
        remote_host="127.0.0.1",
        remote_notify_port=1,
        remote_tp_size=1,
    )
    return worker.moriio_wrapper.reads


def reads_by_layer(
    reads: Sequence[tuple[FakeSession, list[int], list[int]]],
) -> dict[str, list[tuple[int, list[int], list[int]]]]:
    """Each layer's posted READs as (region, local offsets, remote offsets)."""
    posted: dict[str, list[tuple[int, list[int], list[int]]]] = {}
    for session, local_offs, remote_offs in reads:
        posted.setdefault(session.layer, []).append(
            (session.region, local_offs, remote_offs)
        )
    return posted


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
        for layer in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[layer]
            regions = 2 if isinstance(spec, MambaSpec) else 1
            worker.layer_name_to_local_kv_cache_metadata[layer] = [b""] * regions
            sessions += [FakeSession(layer, r) for r in range(regions)]
    worker._get_built_session = lambda engine_id: (sessions, object())
    worker._region_session_indices = lambda layer: [
        i for i, s in enumerate(sessions) if s.layer == layer
    ]

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


# --------------------------------------------------------------------------
# Registered KV cache tensors, a READ carried out byte by byte
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """A registered tensor, standing for its memory metadata."""

    tensor: torch.Tensor


class CopyingWrapper:
    """Stands in for MoRIIOWrapper: a READ on a session (local region, remote
    region) copies the bytes; READs and notifications are recorded."""

    def __init__(self, **_: Any) -> None:
        self.lock = threading.Lock()
        self.notify_port = 0
        self.reads: list[tuple[Region, list[int]]] = []
        self.notified: list[str] = []

    def set_moriio_engine(self, engine: Any) -> None:
        pass

    def set_backend_type(self, *_: Any, **__: Any) -> None:
        pass

    def register_local_tensor(self, tensor: torch.Tensor) -> Region:
        return Region(tensor)

    def get_agent_metadata(self) -> bytes:
        return b""

    def async_wait_reqid(self) -> None:
        pass

    def read_remote_data(self, sizes, local_offsets, remote_offsets, session):
        local, remote = session
        self.reads.append((local, list(sizes)))
        dst, src = local.tensor.view(torch.uint8), remote.tensor.view(torch.uint8)
        for lo, ro, size in zip(local_offsets, remote_offsets, sizes, strict=True):
            dst[lo : lo + size] = src[ro : ro + size]
        return DoneStatus()

    def write_remote_data(self, sizes, local_offsets, remote_offsets, session):
        """A WRITE on a session copies the local region's bytes into the
        remote one."""
        local, remote = session
        src, dst = local.tensor.view(torch.uint8), remote.tensor.view(torch.uint8)
        for lo, ro, size in zip(local_offsets, remote_offsets, sizes, strict=True):
            dst[ro : ro + size] = src[lo : lo + size]
        return DoneStatus()

    def send_notify(self, transfer_id, host, port, **_: Any) -> None:
        self.notified.append(str(port))

    def waiting_for_transfer_complete(self, *_: Any, **__: Any) -> None:
        """Every copy above is done when it returns."""

    def shutdown(self) -> None:
        pass


@dataclass
class RegisteredWorker:
    """A real worker and the KV cache tensors it registered, all views of
    one page-aligned byte buffer."""

    worker: Any
    kv_cache_config: KVCacheConfig
    kv_caches: dict[str, torch.Tensor]
    buffer: torch.Tensor


_LIVE_WORKERS: list[Any] = []


def shut_down_workers() -> None:
    """Shut down every worker ``register_worker`` built (the teardown of the
    tests that read byte by byte)."""
    while _LIVE_WORKERS:
        _LIVE_WORKERS.pop().shutdown()


def register_worker(
    vllm_config: VllmConfig,
    layer_specs: dict[str, KVCacheSpec],
    kv_layout: str,
    engine_id: str,
) -> RegisteredWorker:
    """The real ``MoRIIOConnectorWorker`` registering the KV cache tensors
    vLLM's planner and ``allocate_kv_cache`` lay out for ``layer_specs`` in
    ``kv_layout`` (a small pool)."""
    vllm_config.cache_config.kv_cache_layout = kv_layout
    vllm_config.model_config.max_model_len = 256
    with set_current_vllm_config(vllm_config):
        groups = get_kv_cache_groups(vllm_config, layer_specs)
        kv_cache_config = get_kv_cache_configs(
            vllm_config, [layer_specs], [2 * 1024 * 1024], groups
        )[0]
    kv_cache_config.kv_cache_layout = kv_layout
    buffers: list[torch.Tensor] = []

    def allocate(size: int) -> torch.Tensor:
        # Page-aligned and padded to whole pages, as on ROCm: MoRIIO registers
        # the shared backing as one memory region.
        pages = mmap.mmap(-1, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        buffers.append(torch.frombuffer(pages, dtype=torch.int8))
        return buffers[-1]

    kv_caches = allocate_kv_cache(
        kv_cache_config,
        torch.device("cpu"),
        KVCacheLayout[kv_layout],
        allocate=allocate,
    )
    (buffer,) = buffers
    with set_current_vllm_config(vllm_config):
        worker = moriio_connector.MoRIIOConnectorWorker(
            vllm_config, engine_id, kv_cache_config
        )
        worker.register_kv_caches(kv_caches)
    _LIVE_WORKERS.append(worker)
    return RegisteredWorker(
        worker, kv_cache_config, kv_caches, buffer.view(torch.uint8)
    )


def random_tp_rank(
    monkeypatch: pytest.MonkeyPatch,
    model_dir: Path,
    role: str,
    tp: tuple[int, int],
    kv_layout: str,
    layer_specs: dict[str, KVCacheSpec],
    block_size: int,
) -> RegisteredWorker:
    """Rank ``tp[1]`` of a leg of ``tp[0]`` ranks in ``role``: a registered
    worker whose caches are filled at random (seeded by rank and role)."""
    tp_size, tp_rank = tp
    pin_tp_rank(monkeypatch, tp_size, tp_rank)
    vllm_config = make_vllm_config(
        model_dir, moriio_kv_transfer_config(role), block_size=block_size
    )
    rank = register_worker(
        vllm_config, layer_specs, kv_layout, f"127.0.0.1:{role}{tp_rank}"
    )
    generator = torch.Generator().manual_seed(1000 * tp_size + 10 * tp_rank + len(role))
    fill_random(rank.buffer, generator)
    assert (rank.worker.tp_rank, rank.worker.world_size) == (tp_rank, tp_size)
    return rank


def read_as_decode_rank(
    worker: Any,
    d: int,
    local: list[list[int]],
    remote: list[list[int]],
    p_tp: int,
) -> None:
    """Decode rank ``d`` (``worker``) reads ``remote`` into ``local`` (one
    list per transfer group) from a prefill leg of ``p_tp`` ranks, which it
    notifies on port 100 + prefill rank."""
    worker._read_blocks(
        local_block_ids=local,
        remote_block_ids=remote,
        dst_engine_id="127.0.0.1:7000",
        request_id=f"r{d}",
        transfer_id=f"t{d}",
        remote_host="127.0.0.1",
        remote_notify_port=100,
        remote_tp_size=p_tp,
    )


def fill_random(buffer: torch.Tensor, generator: torch.Generator) -> None:
    """Every byte of ``buffer`` (uint8) drawn at random from ``generator``, in
    place: the bytes ``torch.randint(0, 256, ...)`` would draw, without its
    int64 copy."""
    assert buffer.dtype == torch.uint8, buffer.dtype
    buffer.random_(0, 256, generator=generator)


def paired_sessions(local: Any, remote: Any) -> list[tuple[Region, Region]]:
    """One session per region ``local`` registered, paired with ``remote``'s
    region of the same layer, in registration order."""
    return [
        (mine, theirs)
        for layer, metas in local.layer_name_to_local_kv_cache_metadata.items()
        for mine, theirs in zip(
            metas, remote.layer_name_to_local_kv_cache_metadata[layer], strict=True
        )
    ]


def remote_worker_meta(worker: Any) -> Any:
    """What ``worker``'s handshake tells a peer of its state and head layouts
    and its block count (the fields a READ between unequal TP sizes uses)."""
    return types.SimpleNamespace(
        mamba_state_layouts={
            n: x.to_wire() for n, x in worker.mamba_state_layouts.items()
        },
        kv_head_layouts={n: x.to_wire() for n, x in worker.kv_head_layouts.items()},
        num_blocks=worker.num_blocks,
    )


def eager_handshake(monkeypatch: pytest.MonkeyPatch, worker: Any, p_tp: int) -> None:
    """``worker``'s handshake before the forward pass, for one request from a
    prefill leg of ``p_tp`` ranks (one DP rank, this process its TP group)."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
    worker.tp_group = types.SimpleNamespace(cpu_group=None)
    meta = types.SimpleNamespace(
        remote_host="127.0.0.1",
        remote_handshake_port=7000,
        remote_dp_size=1,
        tp_size=p_tp,
    )
    worker._eager_handshake_all_dp_ranks(
        types.SimpleNamespace(reqs_to_recv={"r": meta})
    )


def check_eager_handshake_dials_every_holder(
    monkeypatch: pytest.MonkeyPatch, decode: list[RegisteredWorker], p_tp: int
) -> None:
    """Each of the ``len(decode)`` decode ranks' eager handshakes dials the
    prefill ranks (of ``p_tp``, more than the decode ranks) that hold a share
    of its heads, rank ``d`` those of ``[d * r, (d + 1) * r)``; the workers
    are shut down with the test's others (``shut_down_workers``)."""
    dialed: dict[int, list[int | None]] = {}
    for d, rank in enumerate(decode):

        def handshake(host, port, tp_size, eid, dp, tp, d=d):
            dialed.setdefault(d, []).append(tp)
            return {eid}

        rank.worker._moriio_handshake = handshake
        eager_handshake(monkeypatch, rank.worker, p_tp)
    ratio = p_tp // len(decode)
    assert dialed == {
        d: list(range(d * ratio, (d + 1) * ratio)) for d in range(len(decode))
    }


def mamba_state_views(kv_cache: torch.Tensor, spec: MambaSpec) -> list[torch.Tensor]:
    """The layer's states as vLLM's ``MambaBase.bind_kv_cache`` views them,
    one tensor per state indexed by slot."""
    pages = kv_cache.squeeze(dim=(1, 2))
    views, offset = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        size = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
        views.append(pages[:, offset : offset + size].view(dtype).view(-1, *shape))
        offset += size
    return views


def check_states_copied(
    decoder: RegisteredWorker,
    prefiller: RegisteredWorker,
    state_layers: Mapping[str, MambaSpec],
    before: torch.Tensor,
    decode_slot: int,
    prefill_slot: int,
) -> None:
    """Every state of each of ``state_layers`` in the decoder's
    ``decode_slot`` holds the prefiller's ``prefill_slot``, and no other
    byte of the decoder's buffer changed from ``before``."""
    expected = before.clone()
    for layer, spec in state_layers.items():
        cache = decoder.kv_caches[layer]
        got = mamba_state_views(cache, spec)
        sent = mamba_state_views(prefiller.kv_caches[layer], spec)
        want = mamba_state_views(
            torch.as_strided(
                expected, cache.shape, cache.stride(), cache.storage_offset()
            ),
            spec,
        )
        for state, source, target in zip(got, sent, want, strict=True):
            target[decode_slot] = source[prefill_slot]
            assert torch.equal(
                state[decode_slot].view(torch.uint8),
                source[prefill_slot].view(torch.uint8),
            ), layer
    assert torch.equal(decoder.buffer, expected)


def pin_tp_rank(monkeypatch: pytest.MonkeyPatch, tp_size: int, tp_rank: int) -> None:
    """The MoRIIO modules see this process as rank ``tp_rank`` of
    ``tp_size`` tensor-parallel ranks."""
    world = lambda: tp_size  # noqa: E731
    monkeypatch.setattr(moriio_connector, "get_tensor_model_parallel_world_size", world)
    monkeypatch.setattr(moriio_common, "get_tensor_model_parallel_world_size", world)
    monkeypatch.setattr(
        moriio_common, "get_tensor_model_parallel_rank", lambda: tp_rank
    )


# ==========================================================================
# READ prefill and decode legs, each a real Scheduler
# ==========================================================================
#
# A MoRIIO READ prefill and decode leg, each a real vLLM ``Scheduler``.
#
# Each leg owns a real KV cache manager; the scheduler builds the real MoRIIO
# connector (READ mode opens no socket on the scheduler side). A prompt runs
# on the prefill leg until its ``kv_transfer_params`` come back, then on the
# decode leg, whose first step carries the READ in its connector metadata.
# Forward passes are not modelled: a step only reports one sampled token for
# each request whose prompt is complete.

_SAMPLED_TOKEN = 7


def build_scheduler(
    model_dir: Path,
    kv_role: str,
    groups: Sequence[tuple[list[str], KVCacheSpec]],
    block_size: int,
    num_blocks: int,
    *,
    read_mode: bool = True,
    disable_hma: bool = False,
    extra_config: dict[str, Any] | None = None,
) -> Scheduler:
    """A real ``Scheduler`` over ``groups`` (one block size, prefix caching on)
    with the MoRIIO connector in READ mode (WRITE unless ``read_mode``). In
    WRITE a failed load is recomputed (``kv_load_failure_policy``) and state
    groups cache a state per block ("align" mode), so a decoder hit holds its
    state. ``extra_config`` adds to the connector's extra config."""
    vllm_config = make_vllm_config(
        model_dir,
        moriio_kv_transfer_config(kv_role, read_mode=read_mode, **(extra_config or {})),
        block_size=block_size,
        disable_hybrid_kv_cache_manager=disable_hma,
    )
    if not read_mode:
        assert vllm_config.kv_transfer_config is not None
        vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
        if any(isinstance(spec, MambaSpec) for _, spec in groups):
            vllm_config.cache_config.mamba_cache_mode = "align"
    kv_cache_config = make_kv_cache_config(groups, num_blocks)
    kv_cache_config.hash_block_size = block_size
    kv_cache_config.cache_hit_alignment_tokens = block_size
    with set_current_vllm_config(vllm_config):
        return create_scheduler(vllm_config, num_blocks, kv_cache_config)


_SEED_STRIDE = 50_021
_TAKES_ROW_MAP = "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters


def model_runner_output(req_ids: list[str], **fields: Any) -> ModelRunnerOutput:
    """The runner's output for ``req_ids`` in row order; ``req_id_to_index``
    only where ``ModelRunnerOutput`` still takes it (vLLM 0.33.0 did)."""
    if _TAKES_ROW_MAP:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


def prompt(seed: int, num_tokens: int) -> list[int]:
    """Tokens no other seed shares (its first one already differs), so only a
    deliberate prefix is a hit. Token ids stay below 2**31: vLLM keeps a
    request's tokens as int32."""
    assert num_tokens < _SEED_STRIDE
    tokens = [seed * _SEED_STRIDE + i for i in range(num_tokens)]
    assert tokens[-1] < 2**31
    return tokens


@dataclass
class Read:
    """What the decoder's first step READs, with both legs' tables."""

    num_prompt_tokens: int
    num_prefilled_tokens: int
    """Tokens the prefill leg computed."""
    prefill_tables: list[list[int]]
    """The prefill request's tables when it finished (null block: 0)."""
    decode_tables: list[list[int]]
    decode_hit_tokens: int
    """Prompt tokens the decoder had in its prefix cache (N-1-E)."""
    local_block_ids: list[list[int]]
    remote_block_ids: list[list[int]]


@dataclass
class SchedulerPair:
    prefill: Scheduler
    decode: Scheduler
    block_size: int
    counter: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(self.block_size, sha256)
        self._external: dict[str, int] = {}
        connector = self.decode.connector
        assert connector is not None
        update = connector.update_state_after_alloc

        def record(request: Request, blocks: Any, num_external_tokens: int) -> Any:
            # An asynchronous load is allocated again, without external
            # tokens, once it landed.
            self._external.setdefault(request.request_id, num_external_tokens)
            return update(request, blocks, num_external_tokens)

        connector.update_state_after_alloc = record  # type: ignore[method-assign]

    def _request(self, request_id: str, tokens: list[int], params: Any) -> Request:
        extra = {"kv_transfer_params": params} if params is not None else None
        return Request(
            request_id,
            list(tokens),
            SamplingParams(max_tokens=1, ignore_eos=True, extra_args=extra),
            None,
            block_hasher=self._hasher,
        )

    @staticmethod
    def _step(
        scheduler: Scheduler, finished_sending: set[str] | None = None
    ) -> list[Any]:
        return SchedulerPair._finish_step(
            scheduler, scheduler.schedule(), finished_sending
        )

    @staticmethod
    def _finish_step(
        scheduler: Scheduler, output: Any, finished_sending: set[str] | None = None
    ) -> list[Any]:
        """Report the step as run: one token for every complete prompt; the
        asynchronous loads of requests waiting for them landed."""
        req_ids = list(output.num_scheduled_tokens)
        received = {
            r.request_id
            for r in scheduler.requests.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        sampled = [
            [_SAMPLED_TOKEN]
            if scheduler.requests[r].num_computed_tokens
            >= scheduler.requests[r].num_tokens
            else []
            for r in req_ids
        ]
        result = scheduler.update_from_output(
            output,
            model_runner_output(
                req_ids,
                sampled_token_ids=sampled,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=finished_sending, finished_recving=received
                )
                if finished_sending or received
                else None,
            ),
        )
        return [o for eco in result.values() for o in eco.outputs]

    def prefill_payload(self, request_id: str, tokens: list[int]) -> Any:
        """Run ``tokens`` on the prefill leg; the payload its connector hands
        the decoder (``do_remote_prefill`` set, as a proxy forwards it)."""
        return self.prefill_run(request_id, tokens)[0]

    def prefill_run(
        self, request_id: str, tokens: list[int]
    ) -> tuple[Any, list[list[int]], int]:
        """Run ``tokens`` on the prefill leg: the payload (as
        ``prefill_payload``), the leg's block tables and the prompt tokens it
        computed."""
        request = self._request(
            request_id, tokens, {"do_remote_decode": True, "transfer_id": request_id}
        )
        self.prefill.add_request(request)
        while True:
            for output in self._step(self.prefill):
                if output.kv_transfer_params:
                    tables = self.prefill.kv_cache_manager.get_block_ids(request_id)
                    params = copy.deepcopy(output.kv_transfer_params)
                    params["do_remote_prefill"] = True
                    computed = request.num_computed_tokens
                    return params, [list(t) for t in tables], computed

    def schedule_beside_refused(
        self,
        ok: str,
        bad: str,
        tokens: Mapping[str, list[int]],
        params: Mapping[str, Any],
    ) -> SchedulerOutput:
        """The decoder's step for an intact payload ``ok`` and a refused one
        ``bad``: ``ok`` READs its pages and computes one token, ``bad`` reads
        nothing and prefills its whole prompt locally."""
        for rid in (ok, bad):
            self.decode.add_request(self._request(rid, tokens[rid], params[rid]))
        output = self.decode.schedule()
        meta = output.kv_connector_metadata.reqs_to_recv
        # An asynchronous load is computed once it landed.
        assert output.num_scheduled_tokens.get(ok, 1) == 1
        assert output.num_scheduled_tokens[bad] == len(tokens[bad])
        assert all(meta[ok].local_block_ids)
        assert meta[bad].local_block_ids == [[]] * len(meta[ok].local_block_ids)
        return output

    def _run_local(self, scheduler: Scheduler, request: Request) -> None:
        scheduler.add_request(request)
        while request.request_id in scheduler.requests:
            self._step(scheduler)

    def read(self, tokens: list[int], decode_hit_tokens: int = 0) -> Read:
        """Prefill ``tokens``, then admit them on the decode leg after it
        cached their first ``decode_hit_tokens`` (a local prefix hit)."""
        i = next(self.counter)
        if decode_hit_tokens:
            warm = [*tokens[:decode_hit_tokens], *prompt(10_000 + i, 1)]
            self._run_local(self.decode, self._request(f"warm-{i}", warm, None))
        request_id = f"req-{i}"
        prefill_request = self._request(
            request_id, tokens, {"do_remote_decode": True, "transfer_id": f"t-{i}"}
        )
        self.prefill.add_request(prefill_request)
        params = None
        while params is None:
            outputs = self._step(self.prefill)
            params = next(
                (o.kv_transfer_params for o in outputs if o.kv_transfer_params), None
            )
        prefill_tables = [
            list(group)
            for group in self.prefill.kv_cache_manager.get_block_ids(request_id)
        ]
        num_prefilled_tokens = prefill_request.num_computed_tokens

        decode_params = copy.deepcopy(params)
        decode_params["do_remote_prefill"] = True
        self.decode.add_request(self._request(request_id, tokens, decode_params))
        output = self.decode.schedule()
        decode_tables = [
            list(group)
            for group in self.decode.kv_cache_manager.get_block_ids(request_id)
        ]
        meta = output.kv_connector_metadata.reqs_to_recv[request_id]
        self._finish_step(self.decode, output)
        while request_id in self.decode.requests:
            self._step(self.decode)
        self._step(self.prefill, finished_sending={request_id})
        assert request_id not in self.prefill.requests
        return Read(
            num_prompt_tokens=len(tokens),
            num_prefilled_tokens=num_prefilled_tokens,
            prefill_tables=prefill_tables,
            decode_tables=decode_tables,
            decode_hit_tokens=len(tokens) - 1 - self._external.pop(request_id),
            local_block_ids=[list(g) for g in meta.local_block_ids],
            remote_block_ids=[list(g) for g in meta.remote_block_ids],
        )


def build_scheduler_pair(
    model_dir: Path,
    groups: Sequence[tuple[list[str], KVCacheSpec]],
    block_size: int,
    num_blocks: int = 2048,
) -> SchedulerPair:
    legs = [
        build_scheduler(model_dir, role, groups, block_size, num_blocks)
        for role in ("kv_producer", "kv_consumer")
    ]
    return SchedulerPair(legs[0], legs[1], block_size)


def scheduler_pair_cache(
    model_dir: Path,
    groups: Callable[[int, int], Sequence[tuple[list[str], KVCacheSpec]]],
) -> Callable[[int, int], SchedulerPair]:
    """Scheduler pairs by block size and the layout's other size (a window,
    a chunk): ``groups(block_size, size)``'s layout, each pair built once
    (a module-scoped fixture hands this out)."""

    @functools.cache
    def get(block_size: int, size: int) -> SchedulerPair:
        return build_scheduler_pair(model_dir, groups(block_size, size), block_size)

    return get


WINDOW_LAYOUTS = [
    pytest.param(16, 64, id="b16-w64"),
    pytest.param(16, 40, id="b16-w40"),
    pytest.param(64, 128, id="b64-w128"),
]
"""(block size, window) of the full+window layouts the window tests run."""


def full_and_window_groups(
    block_size: int, window: int
) -> list[tuple[list[str], KVCacheSpec]]:
    """A full-attention group and a sliding-window group of ``window``."""
    return [
        (["model.layers.0.self_attn.attn"], full_attention_spec(block_size)),
        (
            ["model.layers.1.self_attn.attn"],
            sliding_window_spec(block_size, window),
        ),
    ]


def paired_pages(read: Read, group: int) -> list[int]:
    """The page indices READ pairs in ``group``, the same on both legs, none
    of them the null block (id 0). A request with nothing external to load
    reads nothing (its remote lists are then the payload's, only released)."""
    local = read.local_block_ids[group]
    if not any(read.local_block_ids):
        return []
    remote = read.remote_block_ids[group]
    assert 0 not in local and 0 not in remote, (local, remote)
    local_pages = [read.decode_tables[group].index(b) for b in local]
    remote_pages = [read.prefill_tables[group].index(b) for b in remote]
    assert local_pages == remote_pages, (local_pages, remote_pages)
    return local_pages


def lacked_pages(read: Read, block_size: int, first_token: int) -> list[int]:
    """Pages holding a position from ``first_token`` (the first the
    decoder's recomputed token N-1 attends to) up to N-1 that its local hit
    does not hold."""
    first = first_token // block_size
    held = read.decode_hit_tokens // block_size
    return list(range(max(first, held), cdiv(read.num_prompt_tokens - 1, block_size)))


def pages_not_lacked(
    read: Read, block_size: int, first_tokens: Sequence[int]
) -> list[str]:
    """One line for each group whose READ pairs other pages than it lacks,
    ``first_tokens[g]`` the first position group ``g`` attends to."""
    wrong = []
    for group, first_token in enumerate(first_tokens):
        pages = paired_pages(read, group)
        if pages != lacked_pages(read, block_size, first_token):
            wrong.append(f"N={read.num_prompt_tokens} group {group}: read {pages}")
    return wrong


# ==========================================================================
# READ block pairing by position between a producer and a consumer
# ==========================================================================
#
# Exchange prompts between a real MoRIIO READ producer and consumer scheduler
# side and judge the block pairing by position.
#
# A position-indexed block table holds positions ``[k*S, (k+1)*S)`` in block
# ``k`` (``S``: the group's spec block size, times the DCP size when the group
# is DCP-sharded). A pair (decoder block, prefiller block) is correct only when
# both hold the same positions. The decoder recomputes the last prompt token
# (position ``N-1``) and needs from the prefiller every position below it (full
# attention) or every position of its window below it, ``[N-W, N-1)``.
#
# Tables are shaped as vLLM's KV cache manager leaves them: the prompt's blocks
# plus the lookahead slots a leg reserves, and in a window group the null block
# (id 0) wherever ``SlidingWindowManager.remove_skipped_blocks`` freed a block
# below the window of the leg's next token. The prefiller's scheduler frees
# them before ``request_finished`` (``Scheduler._connector_finished``), for the
# tokens it computed (after ``on_new_request`` dropped any); the decoder's KV
# cache manager frees them at allocation, for the ``N-1`` tokens it is given.
# A pair that reads the null block holds no position of the prompt.
#
# ``run_sweep_request`` sweeps prompt lengths for the base-mechanism test,
# which runs it against the pinned base files in a separate interpreter.

# Block ids encode (leg, group, block index); 0 is vLLM's null block.
_PREFILL_BASE = 1_000_000
_DECODE_BASE = 2_000_000
_GROUP_STRIDE = 100_000

BlockLists = list[tuple[list[int], list[int]]]
"""Per transfer group: the decoder's and the prefiller's block lists, which
the workers pair element-wise."""


@dataclass(frozen=True)
class Layout:
    """Full attention, optionally with one sliding-window group, optionally
    followed by one KDA-like Mamba group (hybrid READ).

    ``dcp`` shards the full-attention group's positions; vLLM accepts a
    sliding-window group under DCP only when it is replicated.
    """

    block_size: int
    window: int | None
    dcp: int = 1
    mamba: bool = False

    @property
    def spans(self) -> tuple[int, ...]:
        """Tokens one block holds, per transfer group."""
        full = self.block_size * self.dcp
        return (full,) if self.window is None else (full, self.block_size)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return (None,) if self.window is None else (None, self.window)


@dataclass(frozen=True)
class Case:
    """A layout plus the lookahead slots each leg allocates past the prompt."""

    name: str
    layout: Layout
    prefill_tail: int
    decode_tail: int


class CaseSpec(msgspec.Struct, frozen=True):
    name: str
    block_size: int
    window: int | None
    dcp: int
    prefill_tail: int
    decode_tail: int


class SweepRequest(msgspec.Struct, frozen=True):
    """What the script sweeps: every prompt length 1..max_prompt_tokens."""

    cases: list[CaseSpec]
    max_prompt_tokens: int


class SweepResult(msgspec.Struct, frozen=True):
    """Wrong prompt lengths per case name (what the script prints)."""

    wrong: dict[str, list[int]]


def prefill_id(group: int, index: int) -> int:
    return _PREFILL_BASE + group * _GROUP_STRIDE + index


def decode_id(group: int, index: int) -> int:
    return _DECODE_BASE + group * _GROUP_STRIDE + index


def num_freed_blocks(window: int | None, span: int, num_computed_tokens: int) -> int:
    """Leading blocks of a group that vLLM's KV cache manager has replaced by
    the null block once ``num_computed_tokens`` are computed: those wholly
    below the window of the next token (``get_num_skipped_tokens``)."""
    if window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // span


def allocation(
    layout: Layout,
    num_tokens: int,
    make_id: Callable[[int, int], int],
    num_computed_tokens: int = 0,
) -> list[list[int]]:
    """Position-indexed block ids for ``num_tokens`` slots, per group; a
    Mamba group's table holds its running-state slot last. A window group's
    blocks freed for ``num_computed_tokens`` computed tokens are the null
    block (0)."""
    tables = []
    for g, (span, window) in enumerate(zip(layout.spans, layout.windows, strict=True)):
        table = list(range(make_id(g, 0), make_id(g, cdiv(num_tokens, span))))
        freed = min(num_freed_blocks(window, span, num_computed_tokens), len(table))
        tables.append([0] * freed + table[freed:])
    if layout.mamba:
        pages = cdiv(num_tokens, layout.block_size)
        tables.append([0] * (pages - 1) + [make_id(len(tables), pages - 1)])
    return tables


def needed_blocks(num_prompt_tokens: int, span: int, window: int | None) -> range:
    """Block indices holding positions the last prompt token reads from P."""
    if num_prompt_tokens < 2:
        return range(0)
    last = num_prompt_tokens - 2
    first = 0 if window is None else max(0, num_prompt_tokens - window)
    return range(first // span, last // span + 1)


def pairing_errors(
    layout: Layout,
    num_prompt_tokens: int,
    lists: Sequence[tuple[list[int], list[int]]],
    *,
    judge_null: bool = True,
) -> list[str]:
    """Why a pairing is wrong; empty when every pair is positional, none holds
    the null block and every needed decoder block is paired.

    ``judge_null=False`` judges only the pairs between live blocks: a pair
    with the null block on either side is skipped, and a needed decoder block
    paired with the prefiller's null block counts as paired. That block was
    freed by vLLM's scheduler before the connector saw the table (the
    window-start fix and its tests); the pairs between live blocks are
    judged here.
    """
    num_groups = len(layout.spans) + layout.mamba
    if len(lists) != num_groups:
        return [f"{len(lists)} groups paired, layout has {num_groups}"]
    errors: list[str] = []
    if layout.mamba:
        m = len(layout.spans)
        local_ids, remote_ids = lists[m]
        d_slot = [(b - decode_id(m, 0)) // _GROUP_STRIDE for b in local_ids]
        p_slot = [(b - prefill_id(m, 0)) // _GROUP_STRIDE for b in remote_ids]
        # A one-token prompt needs no state: nothing precedes the token the
        # decoder computes (READ then reads none, once it skips held state).
        slots = [([0], [0])] + ([([], [])] if num_prompt_tokens == 1 else [])
        if (d_slot, p_slot) not in slots:
            errors.append(f"Mamba: {local_ids} <- {remote_ids}, not one state slot")
    for g, (span, window) in enumerate(zip(layout.spans, layout.windows, strict=True)):
        local_ids, remote_ids = lists[g]
        if local_ids and len(local_ids) != len(remote_ids):
            errors.append(
                f"group {g}: {len(local_ids)} decoder blocks, "
                f"{len(remote_ids)} prefiller blocks"
            )
        # Decoder block indices whose prefiller block is the null block.
        freed_at_source: set[int] = set()
        if judge_null and (0 in local_ids or 0 in remote_ids):
            errors.append(
                f"group {g}: a pair reads the null block: {local_ids} <- {remote_ids}"
            )
        elif not judge_null:
            pairs = list(zip(local_ids, remote_ids, strict=False))
            freed_at_source = {lb - decode_id(g, 0) for lb, rb in pairs if rb == 0}
            live = [(lb, rb) for lb, rb in pairs if lb != 0 and rb != 0]
            local_ids, remote_ids = [lb for lb, _ in live], [rb for _, rb in live]
        n = min(len(local_ids), len(remote_ids))
        # Block index within this group's table (out of range: another group).
        local = [b - decode_id(g, 0) for b in local_ids[:n]]
        remote = [b - prefill_id(g, 0) for b in remote_ids[:n]]
        in_group = not local or 0 <= min(local) <= max(local) < _GROUP_STRIDE
        if local != remote or not in_group:
            errors.extend(
                f"group {g}: decoder block id {lb} <- prefiller block id {rb}"
                for lb, rb, lk, rk in zip(
                    local_ids[:n], remote_ids[:n], local, remote, strict=True
                )
                if lk != rk or not 0 <= lk < _GROUP_STRIDE
            )
        needed = needed_blocks(num_prompt_tokens, span, window)
        if needed and not (
            local
            and local[0] <= needed.start
            and needed.stop - 1 <= local[-1]
            and local == list(range(local[0], local[0] + len(local)))
        ):
            missing = sorted(set(needed) - set(local) - freed_at_source)
            if missing:
                errors.append(f"group {g}: needed decoder blocks {missing} not read")
    return errors


def predicted_wrong_on_base(
    layout: Layout,
    num_prompt_tokens: int,
    prefill_lens: Sequence[int],
    decode_lens: Sequence[int],
) -> bool:
    """The base's mispairing, from the table lengths each leg hands over.

    Each leg clips its own table: a sliding-window group to its last
    ``cdiv(W, S) + 1`` blocks, a full-attention group not at all. The consumer
    then pairs the lists from their ends: a longer consumer list keeps its
    head, a longer producer list gives its suffix. So the pairs shift when the
    decoder's table is the longer one and longer than the clip (both clipped
    lists end one block apart), or whenever the prefiller's is the longer one
    (its suffix starts one block later than the decoder's list). With equal
    tables the pairs hold, but a clip counted from a table end past the
    prompt's blocks can start after the window's first block. And the base
    prefiller computes all N tokens, so its window group's blocks below
    ``N-W+1`` are freed: a pair that reaches below that (the window's first
    block when ``N-W`` ends its block), or below the decoder's own freed
    blocks (``N-W``), reads the null block.
    """
    if num_prompt_tokens < 2:
        return False
    for span, window, p_len, d_len in zip(
        layout.spans, layout.windows, prefill_lens, decode_lens, strict=True
    ):
        p_index, d_index = list(range(p_len)), list(range(d_len))
        if window is not None:
            clip = cdiv(window, span) + 1
            p_index, d_index = p_index[-clip:], d_index[-clip:]
        if len(d_index) > len(p_index):
            d_index = d_index[: len(p_index)]
        elif len(d_index) < len(p_index):
            p_index = p_index[-len(d_index) :] if d_index else []
        p_freed = num_freed_blocks(window, span, num_prompt_tokens)
        d_freed = num_freed_blocks(window, span, num_prompt_tokens - 1)
        needed = needed_blocks(num_prompt_tokens, span, window)
        if (
            d_index != p_index
            or any(k < p_freed for k in p_index)
            or any(k < d_freed for k in d_index)
            or not set(needed) <= set(d_index)
        ):
            return True
    return False


def predicted(case: Case, prompt_lengths: Iterable[int]) -> list[int]:
    spans = case.layout.spans
    return [
        n
        for n in prompt_lengths
        if predicted_wrong_on_base(
            case.layout,
            n,
            [cdiv(n + case.prefill_tail, s) for s in spans],
            [cdiv(n + case.decode_tail, s) for s in spans],
        )
    ]


@functools.cache
def _sampling_params() -> SamplingParams:
    return SamplingParams(max_tokens=1, ignore_eos=True)


def make_sweep_request(
    request_id: str, num_prompt_tokens: int, params: dict[str, Any]
) -> Request:
    """A real ``Request`` whose kv_transfer_params (the attribute ``Request``
    fills from ``SamplingParams.extra_args``) are ``params``. Sweeps build tens
    of thousands, so they share one unchanging ``SamplingParams``."""
    request = Request(request_id, [1] * num_prompt_tokens, _sampling_params(), None)
    request.kv_transfer_params = params
    return request


class _HandedTableManager(KVCacheManager):
    """vLLM's KV cache manager whose one request holds ``table``."""

    table: tuple[list[int], ...] = ()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.table


@dataclass
class LegPair:
    """A real producer and consumer scheduler side for one layout."""

    layout: Layout
    producer: MoRIIOConnector
    consumer: MoRIIOConnector
    kv_cache_config: KVCacheConfig
    decode_blocks: list[list[KVCacheBlock]]
    counter: itertools.count[int] = field(default_factory=itertools.count)
    # What the pair was built from (model directory, D's token capacity):
    # with the layout, what its reads depend on in one process (`sweep`).
    built_from: tuple[str, int] | None = None

    def prefill(
        self,
        num_prompt_tokens: int,
        prefill_tail: int = 0,
        table: Sequence[Sequence[int]] | None = None,
        *,
        clip: bool = False,
    ) -> dict[str, Any]:
        """P's ``request_finished_all_groups``: the params D receives.

        Without ``table``, P's table is allocated for the tokens P computes
        (``on_new_request`` may drop the last one) plus ``prefill_tail``
        lookahead slots, with its window group freed for those tokens; with
        ``clip``, handed over as vLLM's scheduler clips it to those tokens
        (``scheduler_handoff``)."""
        i = next(self.counter)
        request = make_sweep_request(
            f"p-{i}",
            num_prompt_tokens,
            {"do_remote_decode": True, "transfer_id": f"t-{i}"},
        )
        self.producer.on_new_request(request)
        if table is None:
            computed = request.num_prompt_tokens
            table = allocation(
                self.layout, computed + prefill_tail, prefill_id, computed
            )
            if clip:
                table = scheduler_handoff(self, table, computed)
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = self.producer.request_finished_all_groups(
            request, tuple(list(group) for group in table)
        )
        assert params is not None and "remote_block_ids" in params
        return params

    def decode(
        self, num_prompt_tokens: int, params: dict[str, Any], decode_tail: int
    ) -> str:
        """D's admission with ``decode_tail`` lookahead slots; the request id."""
        request = make_sweep_request(
            f"d-{next(self.counter)}", num_prompt_tokens, params
        )
        num_external, _ = self.consumer.get_num_new_matched_tokens(request, 0)
        num_tokens = num_prompt_tokens + decode_tail
        groups = []
        for group, span, window in zip(
            self.decode_blocks, self.layout.spans, self.layout.windows, strict=True
        ):
            table = group[: cdiv(num_tokens, span)]
            # D's KV cache manager is given N-1 computed tokens (READ).
            freed = num_freed_blocks(window, span, num_prompt_tokens - 1)
            groups.append([_null_block()] * freed + table[freed:])
        if self.layout.mamba:
            pages = cdiv(num_tokens, self.layout.block_size)
            m = len(self.layout.spans)
            groups.append(
                [KVCacheBlock(block_id=0)] * (pages - 1)
                + [KVCacheBlock(block_id=decode_id(m, pages - 1))]
            )
        blocks = KVCacheBlocks(tuple(groups))
        self.consumer.update_state_after_alloc(request, blocks, num_external)
        return request.request_id

    @functools.cached_property
    def kv_cache_manager(self) -> _HandedTableManager:
        """A real KV cache manager for P's layout (``scheduler_handoff``)."""
        spans = [
            resolve_dcp_kv_block_size(g.kv_cache_spec, self.layout.dcp)
            for g in self.kv_cache_config.kv_cache_groups
        ]
        return _HandedTableManager(
            self.kv_cache_config,
            max_model_len=2 * MAX_PROMPT_TOKENS,
            scheduler_block_size=math.lcm(*spans),
            hash_block_size=self.layout.block_size,
            enable_caching=False,
            dcp_world_size=self.layout.dcp,
        )

    def reads(self) -> dict[str, BlockLists]:
        """D's ``build_connector_meta``: per request, the block lists READ."""
        meta = self.consumer.build_connector_meta(SchedulerOutput.make_empty())
        return {
            req_id: [
                (list(local), list(remote))
                for local, remote in zip(
                    req.local_block_ids, req.remote_block_ids, strict=True
                )
            ]
            for req_id, req in meta.reqs_to_recv.items()  # type: ignore[attr-defined]
        }

    def exchange(
        self,
        num_prompt_tokens: int,
        prefill_tail: int,
        decode_tail: int,
        prefill_table: Sequence[Sequence[int]] | None = None,
    ) -> BlockLists:
        params = self.prefill(num_prompt_tokens, prefill_tail, prefill_table)
        req_id = self.decode(num_prompt_tokens, dict(params), decode_tail)
        return self.reads()[req_id]


def _null_block() -> KVCacheBlock:
    block = KVCacheBlock(block_id=0)
    block.is_null = True
    return block


def build_leg_pair(model_dir: Path, layout: Layout, max_tokens: int) -> LegPair:
    """Producer and consumer for ``layout``; D's blocks cover ``max_tokens``."""
    groups: list[tuple[list[str], Any]] = [
        (["model.layers.0.self_attn.attn"], full_attention_spec(layout.block_size))
    ]
    if layout.window is not None:
        sw = sliding_window_spec(
            layout.block_size, layout.window, dcp_sharded=layout.dcp == 1
        )
        groups.append((["model.layers.1.self_attn.attn"], sw))
    if layout.mamba:
        groups.append(
            (["model.layers.2.linear_attn"], kda_mamba_spec(layout.block_size))
        )
    kv_cache_config = make_kv_cache_config(groups)
    legs = []
    for role in ("kv_producer", "kv_consumer"):
        vllm_config = make_vllm_config(
            model_dir, moriio_kv_transfer_config(role), block_size=layout.block_size
        )
        # The scheduler side reads only the size; a real DCP config needs as
        # many TP workers.
        vllm_config.parallel_config.decode_context_parallel_size = layout.dcp
        legs.append(make_scheduler_connector(vllm_config, kv_cache_config))
    decode_blocks = [
        [KVCacheBlock(block_id=decode_id(g, k)) for k in range(cdiv(max_tokens, span))]
        for g, span in enumerate(layout.spans)
    ]
    pair = LegPair(layout, legs[0], legs[1], kv_cache_config, decode_blocks)
    pair.built_from = (str(model_dir), max_tokens)
    return pair


def leg_pair_cache(model_dir: Path) -> Callable[[Layout], LegPair]:
    """One real producer/consumer pair per layout, built on first use; D's
    blocks cover every swept prompt plus a lookahead tail."""
    pairs: dict[Layout, LegPair] = {}

    def get(layout: Layout) -> LegPair:
        if layout not in pairs:
            pairs[layout] = build_leg_pair(model_dir, layout, MAX_PROMPT_TOKENS + 64)
        return pairs[layout]

    return get


def scheduler_handoff(
    pair: LegPair, table: Sequence[Sequence[int]], num_computed_tokens: int
) -> list[list[int]]:
    """P's table as vLLM's scheduler hands it to ``request_finished``: clipped
    to the computed tokens by the real
    ``KVCacheManager.get_block_ids_for_computed_tokens``."""
    manager = pair.kv_cache_manager
    manager.table = tuple(list(g) for g in table)
    return [
        list(g)
        for g in manager.get_block_ids_for_computed_tokens(
            request_id="p", num_computed_tokens=num_computed_tokens
        )
    ]


def sweep_summary(
    leg_pairs: Callable[[Layout], LegPair],
    sweep_name: str,
    *,
    judge_null: bool = True,
    clip: bool = False,
) -> dict[str, tuple[int, list[int]]]:
    """Every prompt length 1..SWEPT_TOKENS of the named sweep: per case
    with wrong lengths, their count and the first few."""
    cases = SWEEPS[sweep_name]
    wrong = sweep(
        leg_pairs(cases[0].layout),
        cases,
        range(1, SWEPT_TOKENS + 1),
        judge_null=judge_null,
        clip=clip,
    )
    return {name: (len(ns), ns[:8]) for name, ns in wrong.items() if ns}


def assert_sweep_reads_every_needed_block(
    leg_pairs: Callable[[Layout], LegPair], sweep_name: str, *, clip: bool = False
) -> None:
    """Every prompt length of the named sweep reads every block the decoder
    needs (a pair with the null block is left to the window-start tests);
    ``clip``: P's tables as vLLM's scheduler hands them over."""
    summary = sweep_summary(leg_pairs, sweep_name, judge_null=False, clip=clip)
    assert not summary, f"wrong prompt lengths (count, first): {summary}"


def prefiller_tail_errors(
    pair: LegPair, handoff: str, prefill_tail: int = 8
) -> list[str]:
    """Full attention, only the prefiller holds ``prefill_tail`` lookahead
    slots; ``handoff`` is "allocation" (P's table as allocated) or
    "scheduler" (as vLLM's scheduler clips it). One line per wrong N."""
    span = pair.layout.spans[0]
    wrong: list[str] = []
    for n in range(1, 4 * span + 1):
        table = allocation(pair.layout, n + prefill_tail, prefill_id)
        if handoff == "scheduler":
            table = scheduler_handoff(pair, table, n)
        errors = pairing_errors(pair.layout, n, pair.exchange(n, 0, 0, table))
        if errors:
            wrong.append(f"N={n}: {errors[0]}")
    return wrong


# The reads of a sweep already run in this process, per pair (layout, what
# it was built from), cases and lengths: the connector is the same for the
# whole process, so a second test sweeping the same cases (two modules' named
# tests both sweep SWEEPS) judges the same reads, each
# test with its own judgement.
_SWEPT: dict[tuple[Any, ...], list[tuple[Case, int, BlockLists]]] = {}


def sweep(
    pair: LegPair,
    cases: Sequence[Case],
    prompt_lengths: Iterable[int],
    *,
    judge_null: bool = True,
    clip: bool = False,
) -> dict[str, list[int]]:
    """Wrong prompt lengths per case (``pairing_errors``), both legs' tables
    shaped as the KV cache manager leaves them (prompt plus lookahead slots,
    window blocks freed; ``clip``: P's as vLLM's scheduler hands it over).
    Cases sharing a prefiller tail share its ``request_finished``."""
    assert all(c.layout == pair.layout for c in cases)
    lengths = tuple(prompt_lengths)
    key = (pair.layout, pair.built_from, tuple(cases), lengths, clip)
    swept = _SWEPT.get(key) if pair.built_from is not None else None
    if swept is None:
        swept = _sweep_reads(pair, cases, lengths, clip)
        if pair.built_from is not None:
            _SWEPT[key] = swept
    wrong: dict[str, list[int]] = {c.name: [] for c in cases}
    for case, n, read in swept:
        if pairing_errors(pair.layout, n, read, judge_null=judge_null):
            wrong[case.name].append(n)
    return {name: sorted(ns) for name, ns in wrong.items()}


def _sweep_reads(
    pair: LegPair, cases: Sequence[Case], prompt_lengths: Iterable[int], clip: bool
) -> list[tuple[Case, int, BlockLists]]:
    """Each case's reads at each prompt length."""
    by_tail: dict[int, list[Case]] = {}
    for c in cases:
        by_tail.setdefault(c.prefill_tail, []).append(c)
    pending: list[tuple[Case, int, str]] = []
    swept: list[tuple[Case, int, BlockLists]] = []

    def collect() -> None:
        reads = pair.reads()
        swept.extend((case, n, reads[req_id]) for case, n, req_id in pending)
        pending.clear()

    for n in prompt_lengths:
        for p_tail, tail_cases in by_tail.items():
            params = pair.prefill(n, p_tail, clip=clip)
            for case in tail_cases:
                pending.append(
                    (case, n, pair.decode(n, dict(params), case.decode_tail))
                )
        if len(pending) >= 512:
            collect()
    collect()
    return swept


def sweep_cases(
    model_dir: Path, cases: Sequence[Case], max_prompt_tokens: int
) -> dict[str, list[int]]:
    """Every prompt length 1..max_prompt_tokens, one scheduler pair per layout."""
    wrong: dict[str, list[int]] = {}
    layouts = list(dict.fromkeys(c.layout for c in cases))
    max_tail = max((max(c.prefill_tail, c.decode_tail) for c in cases), default=0)
    for layout in layouts:
        pair = build_leg_pair(model_dir, layout, max_prompt_tokens + max_tail)
        layout_cases = [c for c in cases if c.layout == layout]
        wrong.update(sweep(pair, layout_cases, range(1, max_prompt_tokens + 1)))
    return wrong


def encode_request(cases: Sequence[Case], max_prompt_tokens: int) -> str:
    specs = [
        CaseSpec(
            c.name,
            c.layout.block_size,
            c.layout.window,
            c.layout.dcp,
            c.prefill_tail,
            c.decode_tail,
        )
        for c in cases
    ]
    return msgspec.json.encode(SweepRequest(specs, max_prompt_tokens)).decode()


MAX_PROMPT_TOKENS = 4096
SWEPT_TOKENS = 1024
"""The sweeps' longest prompt: past every window (512) plus its lookahead
tail and four times the longest span (64-token blocks over 4 DCP ranks),
so each case's failing lengths repeat below it. Checked on the stack below
0002, 0036 and 0008: every residue (mod 16 to 512) of a length in 1..4096
a sweep case gets wrong there is one of a wrong length up to 1024."""
# Prompt lengths upstream saw answered wrongly on DeepSeek-V4-Pro (block 64,
# window 128, 9 decode lookahead slots).
UPSTREAM_WRONG_LENGTHS = (251, 377, 384, 440, 447, 636, 832, 895)

DSV4 = Layout(block_size=64, window=128)
SMALL = Layout(block_size=16, window=32)

SWEEPS: dict[str, tuple[Case, ...]] = {
    "b64-w128": (
        Case("b64-w128-d9", DSV4, 0, 9),
        Case("b64-w128-p9d9", DSV4, 9, 9),
    ),
    "b16-w32-d1to8": tuple(Case(f"b16-w32-d{k}", SMALL, 0, k) for k in range(1, 9)),
    **{
        f"dcp{dcp}-b64-w128": (
            Case(f"dcp{dcp}-b64-w128-d9", Layout(64, 128, dcp), 0, 9),
            Case(f"dcp{dcp}-b64-w128-p9", Layout(64, 128, dcp), 9, 0),
        )
        for dcp in (2, 4)
    },
}
ALL_SWEEP_CASES = tuple(c for cases in SWEEPS.values() for c in cases)


def run_sweep_request(model_dir: Path, request: str) -> str:
    """Run a JSON ``SweepRequest``; return the ``SweepResult`` as JSON. The
    base-mechanism test calls it in an interpreter whose MoRIIO package was
    redirected to the base files first."""
    spec = msgspec.json.decode(request, type=SweepRequest)
    cases = [
        Case(
            c.name, Layout(c.block_size, c.window, c.dcp), c.prefill_tail, c.decode_tail
        )
        for c in spec.cases
    ]
    wrong = sweep_cases(model_dir, cases, spec.max_prompt_tokens)
    return msgspec.json.encode(SweepResult(wrong)).decode()


# ==========================================================================
# READ with a decoder prefix hit: the pages paired
# ==========================================================================
#
# Drive a READ transfer with a decoder prefix hit through the real
# scheduler-side MoRIIO connector, and read back the pages it pairs.
#
# A producer finishes the prefill (``request_finished_all_groups``), a consumer
# admits the same prompt (``get_num_new_matched_tokens``,
# ``update_state_after_alloc``, ``build_connector_meta``) with
# position-indexed tables as the KV cache manager hands them over: page k of a
# group holds tokens [k*P, (k+1)*P), P the group's block size times the DCP
# size when the spec is DCP-sharded.

# Block ids encode (leg, group, page); 0 is vLLM's null block.
_HIT_PREFILL_BASE = 10_000_000
_HIT_DECODE_BASE = 20_000_000
_GROUP_STRIDE = 100_000


@dataclass(frozen=True)
class Group:
    """One KV cache group of a layout.

    kind: "target" (the model's MLA group; every target group has the same
    spec, so they share one prefix hit), "full" (a Llama-like full-attention
    group), "drafter" (an EAGLE drafter owning a full-attention group of its
    own spec), "window" (a 64-token sliding window), "kda" (recurrent
    state), "wrapped" (the target's MLA layers and an fp8 indexer cache, a
    full-attention group in ``UniformTypeKVCacheSpecs`` as the workers'
    configs hold it).
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
        if self.kind == "window":
            return sliding_window_spec(self.block_size, 64)
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
    specs = [group.group_spec(i) for i, group in enumerate(groups)]
    return make_leg_connector(model_dir, role, specs, dcp=dcp)


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
    return [
        table(_HIT_DECODE_BASE, i, g, num_tokens, dcp) for i, g in enumerate(groups)
    ]


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
            _HIT_PREFILL_BASE,
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
        first = _HIT_DECODE_BASE // _GROUP_STRIDE + group_index
        assert all(b // _GROUP_STRIDE == first for b in local)
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
    # Asynchronous where vLLM recovers no failed synchronous load.
    assert not load_async or reported > 0
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
class ManagerRead:
    """A READ whose decoder hit comes from the real KV cache manager: the
    hit per group (blocks held), the decoder's tables, and the pages READ
    fills per transfer slot (``attn_group_ids[slot]`` is its group)."""

    local_hit: int
    diverged: bool
    held: list[int]
    tables: list[list[int]]
    read: list[list[int]]
    attn_group_ids: list[int]
    num_prompt_tokens: int
    block_size: int

    def lacking(self, group: int) -> list[int]:
        """The group's blocks past its hit, up to the recomputed token."""
        end = cdiv(self.num_prompt_tokens - 1, self.block_size)
        return list(self.tables[group][self.held[group] : end])


def read_after_manager_hit(
    model_dir: Path,
    groups: Sequence[Group],
    block: int,
    *,
    divergent: bool,
    stated_group_hits: bool = False,
) -> ManagerRead:
    """An earlier 200-token request leaves 160 shared tokens in the prefix
    cache of a real ``KVCacheManager`` (EAGLE on); a 220-token prompt with
    that prefix is then prefilled remotely and admitted by a READ consumer
    with the manager's hit (``divergent``: the per-group hit the connector
    path gets, else the common one). ``stated_group_hits``: the request
    carries each group's hit of a divergent lookup, as vLLM's scheduler
    records it with core patch c005 (computed from the manager's per-group
    lookup where vLLM lacks it)."""
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
    params = finish_prefill(model_dir, groups, 1, request_id, num_prompt_tokens)
    decode = hashed_request(request_id, [*shared, *[9] * 60], block, params)
    diverged = False
    if divergent:
        hit_blocks, local_hit, _, diverged = manager.get_computed_blocks_for_connector(
            decode
        )
        if stated_group_hits:
            hits = getattr(hit_blocks, "num_hit_tokens_per_group", None)
            if hits is None:
                _, hits = manager.coordinator.find_longest_cache_hit_per_group(  # type: ignore[attr-defined]
                    decode.block_hashes, decode.get_max_cache_hit_length()
                )
            setattr(decode, "num_local_hit_tokens_per_group", hits)  # noqa: B010
    else:
        hit_blocks, local_hit, _ = manager.get_computed_blocks(decode)

    consumer = connector(model_dir, groups, 1, "kv_consumer")
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
    return ManagerRead(
        local_hit=local_hit,
        diverged=bool(diverged),
        held=[len(b) for b in hit_blocks.get_block_ids()],
        tables=[list(t) for t in allocated.get_block_ids()],
        read=[list(ids) for ids in meta.reqs_to_recv[request_id].local_block_ids],
        attn_group_ids=list(scheduler._attn_group_ids),
        num_prompt_tokens=num_prompt_tokens,
        block_size=block,
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


# ==========================================================================
# WRITE prefill and decode legs and the prefiller's write planner
# ==========================================================================
#
# A MoRIIO WRITE prefill and decode leg, each a real vLLM ``Scheduler``, and
# the prefiller's real write planner.
#
# The decode leg allocates the request's blocks and sends the prefiller its
# "remote_blocks" message (captured at the ZMQ socket); the prefill leg runs
# the prompt until its connector metadata carries the blocks it saves. The
# prefiller's ``MoRIIOWrapper`` takes the captured message as its notify
# listener does, and ``MoRIIOWriter._prepare_transfer_plan`` plans one layer's
# write against a worker stand-in that records the block pairs it is asked to
# copy (the offsets are vLLM's layout arithmetic, tested elsewhere). Forward
# passes are not modelled.

LAYER = "model.layers.0.self_attn.attn"


def write_params(transfer_id: str, **flags: Any) -> dict[str, Any]:
    """A WRITE request's ``kv_transfer_params`` before its proxy fills in the
    peer (both legs on this host, TP 1); ``flags`` add or override fields."""
    return {
        "transfer_id": transfer_id,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": "127.0.0.1",
        "remote_handshake_port": 1,
        "remote_notify_port": 2,
        "remote_tp_size": 1,
        "remote_dp_size": 1,
        **flags,
    }


class _Socket:
    def __init__(self, sent: list[dict[str, Any]]) -> None:
        self._sent = sent

    def send(self, data: bytes) -> None:
        self._sent.append(msgpack.loads(data))

    def close(self, linger: int = 0) -> None:
        pass


class _Worker:
    """What ``MoRIIOWriter._execute_write_task`` asks of the prefiller's
    worker."""

    def __init__(
        self,
        layers: dict[str, int],
        state_layers: set[str],
        wrapper: Any,
        whole_state_layers: frozenset[str] = frozenset(),
    ) -> None:
        self.kv_caches = {name: torch.zeros(2, 4, 1) for name in layers}
        self.layer_to_group = dict(layers)
        self._state_layers = state_layers
        # The state layers with a conv split (a conv + SSM pair).
        self._conv_decomps = {name: None for name in state_layers - whole_state_layers}
        self._has_mamba = bool(state_layers)
        self._mamba_transfer_group_ids = frozenset(
            group for name, group in layers.items() if name in state_layers
        )
        self.moriio_config = type("C", (), {"defer_timeout": 1.0})()
        self.moriio_wrapper = wrapper
        self.tp_rank = 0
        self.pairs: dict[str, list[tuple[int, int]]] = {}

    def _check_peer_block_size(self, layer_name: str, meta: Any) -> None:
        pass

    def _is_mamba_layer(self, layer_name: str) -> bool:
        return layer_name in self._state_layers

    def _region_session_indices(self, layer_name: str) -> list[int]:
        return [0, 1] if self._is_mamba_layer(layer_name) else [0]

    def _mamba_blocks_for_layer(
        self, layer_name: str, block_groups: Sequence[Sequence[int]]
    ) -> list[int]:
        # WRITE lists are in transfer-group order on both legs.
        return list(block_groups[self.layer_to_group[layer_name]])

    def _compute_mamba_transfer_offsets(
        self,
        layer_name: str,
        local_slots: list[int],
        remote_slots: list[int],
        remote_tp_size: int | None = None,
    ) -> tuple[list[int], list[int], list[int], int]:
        self.pairs[layer_name] = list(zip(local_slots, remote_slots, strict=True))
        return [], [], [], 0

    def _compute_mamba_state_offsets(
        self, layer_name: str, local_slots: list[int], remote_slots: list[int]
    ) -> list[tuple[list[int], list[int], list[int]]]:
        self.pairs[layer_name] = list(zip(local_slots, remote_slots, strict=True))
        return [([], [], [])] * len(self._region_session_indices(layer_name))

    def get_engine_name_with_dp(self, engine_name: str, dp_rank: int) -> str:
        return f"{engine_name}_dp{dp_rank}"

    def _get_built_session(self, engine_id: str) -> tuple[list[Any], Any]:
        return [None], None

    def _compute_block_transfer_offsets(
        self,
        layer_name: str,
        local_block_ids: list[int],
        remote_block_ids: list[int],
        remote_moriio_meta: Any,
        remote_engine_id: Any = None,
    ) -> tuple[list[int], list[int], list[int]]:
        # vLLM's layout pairs the lists by index and stops at the shorter.
        self.pairs[layer_name] = list(
            zip(local_block_ids, remote_block_ids, strict=False)
        )
        return [], [], []


def record_notices(notices: list[Any], with_transfer: bool = False) -> Any:
    """A ``MoRIIOWrapper.send_notify`` that records each message's type (with
    its transfer id) instead of sending it."""

    def send_notify(
        transfer_id: str, ip: str, port: int, message_type: str | None = None, **kw: Any
    ) -> None:
        kind = message_type or ""
        notices.append((transfer_id, kind) if with_transfer else kind)

    return send_notify


class _Event:
    def synchronize(self) -> None:
        pass


@dataclass
class Write:
    """One prompt's WRITE: both legs' tables and the pages written."""

    num_prompt_tokens: int
    decode_hit_tokens: int
    prefill_table: list[int]
    decode_table: list[int]
    message: dict[str, Any]
    pairs: list[tuple[int, int]]
    """(prefill block, decode block) for every page the prefiller writes
    (the first group's)."""
    prefill_tables: list[list[int]] = field(default_factory=list)
    """Every group's prefill table once its prefill finished: the blocks it
    holds while the write is in flight (null block: 0)."""
    decode_tables: list[list[int]] = field(default_factory=list)
    group_pairs: list[list[tuple[int, int]]] = field(default_factory=list)
    """``pairs`` of every group (its first layer's)."""
    pairs_by_layer: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    """Messages the prefiller's writer sent the decoder."""
    released: bool = False
    """The prefiller's writer released its blocks (no write to wait for)."""


@dataclass
class WritePair:
    legs: SchedulerPair
    sent: list[dict[str, Any]] = field(default_factory=list)
    counter: Iterator[int] = field(default_factory=itertools.count)
    layers: dict[str, int] = field(default_factory=lambda: {LAYER: 0})
    """Each layer the prefiller writes and its transfer group."""
    state_layers: set[str] = field(default_factory=set)
    whole_state_layers: set[str] = field(default_factory=set)
    """The state layers without a conv split, each state written whole."""

    def write(
        self, tokens: list[int], decode_hit_tokens: int = 0, message: Any = None
    ) -> Write:
        """Admit ``tokens`` on the decode leg after it cached their first
        ``decode_hit_tokens``, prefill them, and plan the prefiller's write
        from the decoder's message (``message`` edits it first)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
            moriio_common,
            moriio_engine,
        )

        legs = self.legs
        i = next(self.counter)
        if decode_hit_tokens:
            warm = [*tokens[:decode_hit_tokens], *prompt(20_000 + i, 1)]
            legs._run_local(legs.decode, legs._request(f"warm-{i}", warm, None))
        request_id = f"req-{i}"
        params = write_params(f"t-{i}")
        decode_params = {**params, "do_remote_prefill": True}
        legs.decode.add_request(legs._request(request_id, tokens, decode_params))
        self.sent.clear()
        legs._finish_step(legs.decode, legs.decode.schedule())
        (sent,) = self.sent
        decode_tables = [
            list(g) for g in legs.decode.kv_cache_manager.get_block_ids(request_id)
        ]

        prefill_params = {**params, "do_remote_decode": True}
        legs.prefill.add_request(legs._request(request_id, tokens, prefill_params))
        saved = None
        # The connector's role is one per process (the last leg built): the
        # prefiller finds its final chunk of a split prompt only as producer.
        with _role(moriio_common, moriio_common.ROLE.PRODUCER):
            while saved is None:
                output = legs.prefill.schedule()
                saved = output.kv_connector_metadata.reqs_to_save.get(request_id)
                prefill_table = list(
                    legs.prefill.kv_cache_manager.get_block_ids(request_id)[0]
                )
                legs._finish_step(legs.prefill, output)
        prefill_tables = [
            list(g) for g in legs.prefill.kv_cache_manager.get_block_ids(request_id)
        ]

        delivered = copy.deepcopy(sent)
        if message is not None:
            message(delivered)
        notices: list[str] = []
        layers = self.layers
        if len(set(layers.values())) < len(decode_tables):
            # One layer per group where the pair names none.
            layers = {
                f"{LAYER}.{g}" if g else LAYER: g for g in range(len(decode_tables))
            }
        with _role(moriio_common, moriio_common.ROLE.PRODUCER):
            wrapper = moriio_engine.MoRIIOWrapper()
            wrapper.send_notify = record_notices(notices)  # type: ignore[method-assign]
            wrapper._handle_message(msgpack.dumps(delivered))
            worker = _Worker(
                layers, self.state_layers, wrapper, frozenset(self.whole_state_layers)
            )
            writer = moriio_engine.MoRIIOWriter(worker)  # type: ignore[arg-type]
            for layer in layers:
                task = type(
                    "Task",
                    (),
                    {
                        "request_id": request_id,
                        "transfer_id": delivered["transfer_id"],
                        "dst_engine_id": "decode",
                        "local_block_ids": [list(g) for g in saved.local_block_ids],
                        "write_start_blocks": getattr(
                            saved, "write_start_blocks", None
                        ),
                        "layer_name": layer,
                        "tp_mapping": None,
                        "refusal": None,
                        "remote_tp_size": 1,
                        "event": _Event(),
                        "remote_ip": "127.0.0.1",
                        "remote_notify_port": 2,
                        "multi_pod_hosts": [],
                        "remote_dp_size_local": 0,
                    },
                )()
                if not wrapper._is_transfer_terminal_locked(task.transfer_id):
                    writer._execute_write_task(task)  # type: ignore[arg-type]
            released = any(
                ack.transfer_id == delivered["transfer_id"]
                for ack in wrapper.done_req_ids
            )
        first_layers = {g: name for name, g in reversed(layers.items())}
        group_pairs = [
            worker.pairs.get(first_layers.get(g, ""), [])
            for g in range(len(decode_tables))
        ]
        return Write(
            num_prompt_tokens=len(tokens),
            decode_hit_tokens=decode_hit_tokens,
            prefill_table=prefill_table,
            decode_table=decode_tables[0],
            message=sent,
            pairs=group_pairs[0],
            prefill_tables=prefill_tables,
            decode_tables=decode_tables,
            group_pairs=group_pairs,
            pairs_by_layer=worker.pairs,
            notices=notices,
            released=released,
        )


@contextmanager
def _role(moriio_common: Any, role: Any) -> Iterator[None]:
    before = moriio_common.get_role()
    moriio_common.set_role(role)
    try:
        yield
    finally:
        moriio_common.set_role(before)


def build_write_pair(
    model_dir: Path,
    groups: Sequence[tuple[list[str], KVCacheSpec]],
    block_size: int,
    monkeypatch: pytest.MonkeyPatch,
    num_blocks: int = 1024,
    disable_hma: bool = False,
) -> WritePair:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector as mc,
    )

    legs = [
        build_scheduler(
            model_dir,
            role,
            groups,
            block_size,
            num_blocks,
            read_mode=False,
            disable_hma=disable_hma,
        )
        for role in ("kv_producer", "kv_consumer")
    ]
    pair = WritePair(
        SchedulerPair(legs[0], legs[1], block_size),
        layers={name: g for g, (names, _) in enumerate(groups) for name in names},
        state_layers={
            name
            for names, spec in groups
            if isinstance(spec, MambaSpec)
            for name in names
        },
    )
    monkeypatch.setattr(mc, "make_zmq_socket", lambda **kw: _Socket(pair.sent))
    return pair


def write_pair_fixture(
    layouts: Mapping[str, Callable[[], list[tuple[list[str], KVCacheSpec]]]],
    block_size: int,
) -> Any:
    """A fixture giving a ``WritePair`` for each of ``layouts`` in turn."""

    @pytest.fixture(params=list(layouts))
    def pair(
        request: pytest.FixtureRequest,
        llama_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> WritePair:
        groups = layouts[request.param]()
        return build_write_pair(
            llama_model_dir, groups, block_size, monkeypatch, num_blocks=2048
        )

    return pair


def build_drafted_write_pair(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    groups: Sequence[tuple[list[str], KVCacheSpec]],
    block_size: int,
    speculative_config: dict[str, Any] | None,
    state_layers: set[str],
    method: str | None = None,
) -> WritePair:
    """``build_write_pair``'s legs with a drafter proposing one token, if
    ``speculative_config`` (of ``method`` when given: the configuration
    resolves as its own method, then names this one; the connector reads
    nothing else of it), and the state groups' cache mode "align"."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector as mc,
    )

    legs = []
    for role in ("kv_producer", "kv_consumer"):
        vllm_config = make_vllm_config(
            model_dir,
            moriio_kv_transfer_config(role, read_mode=False),
            block_size=block_size,
            speculative_config=speculative_config,
        )
        if method is not None:
            assert vllm_config.speculative_config is not None
            vllm_config.speculative_config.method = method  # type: ignore[assignment]
        assert vllm_config.kv_transfer_config is not None
        vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
        vllm_config.cache_config.mamba_cache_mode = "align"
        kv_cache_config = make_kv_cache_config(groups, 2048)
        kv_cache_config.hash_block_size = block_size
        kv_cache_config.cache_hit_alignment_tokens = block_size
        with set_current_vllm_config(vllm_config):
            legs.append(create_scheduler(vllm_config, 2048, kv_cache_config))
    names = {name for names, _ in groups for name in names}
    pair = WritePair(
        SchedulerPair(legs[0], legs[1], block_size),
        layers={name: g for g, (names, _) in enumerate(groups) for name in names},
        state_layers=state_layers & names,
    )
    monkeypatch.setattr(mc, "make_zmq_socket", lambda **kw: _Socket(pair.sent))
    return pair


def check_drafted_write(
    pair: WritePair,
    write: Write,
    num_tokens: int,
    hit_pages: int,
    first_page: Callable[[str], int] = lambda layer: 0,
) -> None:
    """Each attention layer's pages past the decoder's held ``hit_pages``
    (and ``first_page(layer)``) up to the page of token N - 2 are written to
    the decoder's pages at the same positions, none a null page; a state
    layer's running slot is written to the decoder's slot, holding none."""
    held = write.message["num_held_blocks"]
    last = cdiv(num_tokens - 1, pair.legs.block_size)
    for layer, group in pair.layers.items():
        pairs = write.pairs_by_layer[layer]
        if layer in pair.state_layers:
            assert held[group] == 0
            ((prefill_slot, decode_slot),) = pairs
            assert prefill_slot in write.prefill_tables[group]
            assert decode_slot == write.message["block_notify_list"][group][-1]
            continue
        assert held[group] == hit_pages, layer
        first = max(hit_pages, first_page(layer))
        prefill, decode = write.prefill_tables[group], write.decode_tables[group]
        assert pairs == [(prefill[k], decode[k]) for k in range(first, last)], layer
        assert all(0 not in p for p in pairs)


def window_write_pair(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    block_size: int,
    window: int,
    with_full: bool,
) -> WritePair:
    """A WRITE pair of real schedulers over one window group of ``window``
    (without the hybrid KV cache manager), or a full-attention group and a
    window group (``with_full``, with it)."""
    groups = [([LAYER], sliding_window_spec(block_size, window))]
    if with_full:
        groups = [([LAYER], full_attention_spec(block_size))] + [
            ([f"{LAYER}.1"], sliding_window_spec(block_size, window))
        ]
    return build_write_pair(
        model_dir, groups, block_size, monkeypatch, disable_hma=not with_full
    )


def expected_window_pairs(
    write: Write, group: int, block_size: int, window: int | None
) -> list[tuple[int, int]]:
    """P's page k to D's page k for every page the decoder lacks that holds a
    position in [N - W, N - 1) (every position below N - 1 for full
    attention)."""
    n = write.num_prompt_tokens
    first = max(n - window, 0) // block_size if window else 0
    first = max(first, write.decode_hit_tokens // block_size)
    return [
        (write.prefill_tables[group][k], write.decode_tables[group][k])
        for k in range(first, cdiv(n - 1, block_size))
    ]


def assert_window_written(
    write: Write, block_size: int, windows: list[int | None]
) -> None:
    assert write.notices == []
    for group, window in enumerate(windows):
        pairs = write.group_pairs[group]
        assert pairs == expected_window_pairs(write, group, block_size, window)
        assert all(0 not in pair for pair in pairs)
