"""One rank of one leg, in its own process, driven over a pipe.

Every rank builds its leg's ``VllmConfig`` and per-rank ``KVCacheConfig``
through vLLM's planner (``simulate.legs.build_leg``), joins its leg's TP group
(vLLM's parallel state on gloo), builds the real ``MoRIIOConnector`` in the
WORKER role, allocates its KV cache in shared memory in vLLM's layout
(``kvmem``) and registers it (``register_kv_caches``: the real handshake
listener, notify listener and memory registration on the ``mori`` stand-in).
Rank 0 also runs the leg's real ``Scheduler``.

Per step the driver sends what vLLM's executor sends a worker: the
scheduler's output (connector metadata, blocks to zero, block copies, the
requests and token ranges to compute). The rank runs the worker side in
vLLM's model-runner order (``kv_connector_model_runner_mixin``): zero, copy,
bind metadata, ``start_load_kv`` before the forward when the step has a
synchronous load, the "forward" (``content`` bytes for every computed
position, the attention layers' ``save_kv_layer`` hooks), ``start_load_kv``
after it otherwise, ``wait_for_save``, ``get_transfer_results``. Rank 0
adds the step's new request and schedules; it hands the plan over first
(``step``: the driver sends it on to the leg's other ranks), or, alone in its
leg, executes it and updates its scheduler in the same round trip
(``step1``). Either way each rank executes a copy of the plan through the
pipe's pickler, as the scheduler's objects never reach a worker.

The watched request of a case is judged byte by byte (``judge``): every byte
the decoder holds for a position it attends to, and every byte that changed
outside the transfer's destination pages.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from vllm_overlay.simulate.builds import use_role
from vllm_overlay.simulate.bytes.content import (
    POISON,
    attention_bytes,
    global_heads,
    layer_key,
    prefix_hashes,
    state_bytes,
)
from vllm_overlay.simulate.bytes.geometry import (
    Geometry,
    layer_total_heads,
    model_json,
    rank_specs,
)
from vllm_overlay.simulate.bytes.kvmem import SharedKV, same_bytes
from vllm_overlay.simulate.bytes.shm import shm_path
from vllm_overlay.simulate.check import (
    FULL,
    LOCAL_ONLY,
    RING,
    STATE_KIND,
    GroupInfo,
    Need,
    needs,
    past_hit,
)
from vllm_overlay.simulate.drive import Pair, group_infos
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.simulate.legs import LegOptions, build_leg
from vllm_overlay.simulate.outputs import model_runner_output

READ, WRITE = "read", "write"


@dataclass(frozen=True)
class Shard:
    """Decode context parallelism as one rank of a group sees it: of a
    table entry's ``size * B`` positions (a virtual block), runs of
    ``interleave`` positions go to ranks in turn, and this rank keeps its
    runs, in order, in its physical block of ``B`` (vLLM's slot mapping,
    ``v1/worker/block_table.py``). ``size`` 1: the group is not sharded."""

    size: int = 1
    rank: int = 0
    interleave: int = 1

    def own(self, positions: np.ndarray, block_tokens: int) -> tuple[Any, Any, Any]:
        """(table index, slot, position) of each position this rank keeps."""
        index, offset = np.divmod(positions, block_tokens)
        mine = (offset // self.interleave) % self.size == self.rank
        index, offset, positions = index[mine], offset[mine], positions[mine]
        run = self.interleave * self.size
        slots = offset // run * self.interleave + offset % self.interleave
        return index, slots, positions


NO_SHARD = Shard()


def _refuse_compressed(info: GroupInfo) -> None:
    if info.tokens_per_state != 1:
        raise NotImplementedError(
            "byte simulator: a compressed cache under decode context "
            "parallelism is not modelled"
        )


def _sharded_rows(
    info: GroupInfo, shard: Shard, table: list[int], start: int, end: int
) -> list[tuple[int, Any, np.ndarray]]:
    _refuse_compressed(info)
    index, slots, positions = shard.own(np.arange(start, end), info.block_tokens)
    out = []
    for k in np.unique(index):
        if k >= len(table) or table[k] == 0:
            continue
        pick = index == k
        out.append((table[k], slots[pick], positions[pick]))
    return out


def _rows(
    info: GroupInfo,
    table: list[int],
    start: int,
    end: int,
    shard: Shard = NO_SHARD,
) -> list[tuple[int, Any, np.ndarray]]:
    """Where a forward over positions ``[start, end)`` writes an attention
    group's rows: (block, slots in it, position whose prefix hash each row
    holds). A ring keeps position p in slot ``p % capacity`` of its one
    block; a compressed cache (one row per ``t`` tokens) writes row r once
    position ``(r + 1) * t - 1`` is computed, hashing that prefix; a block
    holds ``block_tokens / t`` rows. Null blocks take no rows."""
    out: list[tuple[int, Any, np.ndarray]] = []
    if shard.size > 1 and info.kind != RING:
        return _sharded_rows(info, shard, table, start, end)
    if info.kind == RING:
        if table and table[0] != 0 and start < end:
            positions = np.arange(start, end)
            out.append((table[0], positions % info.ring_capacity, positions))
        return out
    t = info.tokens_per_state
    per_block = info.block_tokens // t
    first, stop = start // t, end // t
    for index in range(first // per_block, -(-stop // per_block)):
        if index >= len(table) or table[index] == 0:
            continue
        lo, hi = max(first, index * per_block), min(stop, (index + 1) * per_block)
        if lo < hi:
            rows = np.arange(lo, hi)
            out.append((table[index], rows - index * per_block, (rows + 1) * t - 1))
    return out


def _layer_info(info: GroupInfo, view: Any) -> GroupInfo:
    """``info`` with the layer's own rows per state: a group can mix layers
    of different compression (DeepSeek-V4.1's MLA caches of ratio 1 and 2
    and their indexers, or GLM-5.3-Flash's MLA beside its kpool indexer, in
    one block-outermost group)."""
    if info.kind != FULL:
        return info
    t = max(1, int(getattr(view.spec, "tokens_per_state", 1)))
    return info if t == info.tokens_per_state else info._replace(tokens_per_state=t)


def _slot_rows(view: Any, block: int, info: GroupInfo) -> np.ndarray:
    """A layer's page as ``[H, rows, row bytes]``: the rows ``_rows`` and
    ``_need_rows`` index. A ring whose model addresses rows of its own size
    (``ring_row_bytes``) is re-viewed in them; every other page is the
    layer's ``[H, N, C]`` view."""
    page = view.u8[block]
    if info.kind != RING or not info.ring_row_bytes:
        return page
    rows = page.reshape(page.shape[0], -1, info.ring_row_bytes)
    assert np.shares_memory(rows, page), "ring rows must view the page"
    return rows


def _need_rows(
    info: GroupInfo, need: Need, shard: Shard = NO_SHARD
) -> tuple[Any, np.ndarray]:
    """The slots and hash positions of an attention need (``check.needs``:
    positions ``[lo, hi)`` of block ``index``); under DCP, of the positions
    this rank keeps."""
    if shard.size > 1 and info.kind != RING:
        _refuse_compressed(info)
        _, slots, positions = shard.own(np.arange(need.lo, need.hi), info.block_tokens)
        return slots, positions
    if info.kind == RING:
        positions = np.arange(need.lo, need.hi)
        return positions % info.ring_capacity, positions
    t = info.tokens_per_state
    rows = np.arange(need.lo // t, need.hi // t)
    return rows - need.index * (info.block_tokens // t), (rows + 1) * t - 1


@dataclass(frozen=True)
class RankConfig:
    layout: str
    mode: str
    role: str
    tp_size: int
    tp_rank: int
    kv_layout: str
    handshake_port: int
    notify_port: int
    dist_port: int
    max_model_len: int
    geometry: Geometry = field(default_factory=Geometry)
    fault: str | None = None
    transfer_timeout: float = 20.0
    open_port: int | None = None
    """Where vLLM's ``get_open_port`` starts looking (``VLLM_PORT``), which
    picks the mori engine's port: in the configuration's port block, since
    an ephemeral port it frees and binds again later can meanwhile become the
    source port of any process's outgoing connection. None: vLLM's choice."""
    kv_file: str | None = None
    """The KV cache buffer's file: the driver's slot for this rank, mapped by
    one configuration's rank after another. None: the process's own."""


def _shards(leg: Any, layout: Any, tp_rank: int) -> list[Shard]:
    """Each KV cache group's DCP sharding on this rank: the DCP group is
    ``dcp`` consecutive TP ranks; a group is sharded when its specs are."""
    from vllm.v1.kv_cache_interface import iter_layer_specs

    dcp = layout.dcp
    if dcp == 1:
        return [NO_SHARD] * len(leg.worker_config.kv_cache_groups)
    interleave = leg.vllm_config.parallel_config.cp_kv_cache_interleave_size
    out = []
    for group in leg.worker_config.kv_cache_groups:
        sharded = all(
            getattr(spec, "dcp_sharded", False)
            for spec in iter_layer_specs(group.kv_cache_spec)
        )
        out.append(Shard(dcp, tp_rank % dcp, interleave) if sharded else NO_SHARD)
    return out


def _heads_of(cfg: RankConfig, view: Any, total: int | None) -> list[int]:
    """The global KV heads a rank's layer holds (replicated: all of them)."""
    local = int(view.u8.shape[1])
    if total is None:
        return list(range(local))
    return global_heads(cfg.tp_rank, cfg.tp_size, total, local)


@dataclass
class Compute:
    """Positions ``[start, end)`` of a request computed in this step."""

    rid: str
    tokens: list[int]
    start: int
    end: int
    tables: list[list[int]]


@dataclass
class StepPlan:
    metadata: Any
    zero: list[int]
    copies: list[tuple[int, int]]
    computes: list[Compute]
    has_sync_kv_loads: bool
    finished_req_ids: set[str]
    tables: dict[str, list[list[int]]]
    """Block tables of the watched requests, scheduled or not."""
    payload_groups: list[int]
    """``kv_cache_groups`` index of each list of a READ ``ReqMeta``."""
    local_hits: dict[str, int] = field(default_factory=dict)
    """Prompt tokens of each watched request scheduled this step, or (WRITE)
    allocated this step to wait for the prefiller's write, that the decoder's
    own prefix cache held (its computed tokens less the external ones the
    connector loads)."""


@dataclass
class Watch:
    """The case's request on the decoder: snapshot (``arm``) and judge."""

    rid: str
    n: int
    tokens: list[int]
    arm: bool = False
    judge: bool = False
    dest: str = "meta"
    """Destination pages: ``meta`` (the READ ReqMeta's local lists) or
    ``table`` (the request's block table, WRITE)."""
    judge_if_computed: bool = False
    """WRITE's first decoder step: judge the request in it if the decoder
    computes the request there, before its forward. The decoder's connector
    counted no external token (a state model at a full local hit): it asks
    the prefiller to free its blocks, nothing is written, and the decoder
    computes the last token from what it holds."""

    def judged_in(self, plan: StepPlan) -> bool:
        """Whether the request is judged in the step of ``plan``."""
        return self.judge or (
            self.judge_if_computed and any(c.rid == self.rid for c in plan.computes)
        )


@dataclass
class Verdict:
    """One decoder rank's judgement of one request."""

    wrong_needs: int = 0
    """Pages (positions of a block, or a state) with a wrong byte."""
    wrong_bytes: int = 0
    stray_bytes: int = 0
    """Bytes changed outside the transfer's destination pages."""
    late_reads: int = 0
    """READs posted on a step whose load is not synchronous: vLLM's model
    runner starts that load after the forward, so it lands after the forward
    that needed it, into blocks the request may have freed."""
    min_bytes: int = 0
    """Bytes of the pages the decoder lacked before the transfer."""
    notes: list[str] = field(default_factory=list)


def aggregate(
    results: list[StepResult],
    pending_sending: Counter[str],
    pending_recving: Counter[str],
    tp: int,
) -> dict[str, set[Any]]:
    """The leg's ``KVConnectorOutput`` fields from its ranks' results, as
    vLLM's ``KVOutputAggregator`` makes them: a request finished sending or
    receiving once every rank of the leg said so (``pending_*`` count the
    ranks that did, across steps)."""
    done_send: set[str] = set()
    done_recv: set[str] = set()
    for r in results:
        pending_sending.update(r.finished_sending)
        pending_recving.update(r.finished_recving)
    for rid, count in list(pending_sending.items()):
        if count >= tp:
            done_send.add(rid)
            del pending_sending[rid]
    for rid, count in list(pending_recving.items()):
        if count >= tp:
            done_recv.add(rid)
            del pending_recving[rid]
    return {
        "finished_sending": done_send,
        "finished_recving": done_recv,
        "failed_recving": set().union(*(r.failed_recving for r in results)),
        "invalid_block_ids": set().union(*(r.invalid_block_ids for r in results)),
    }


@dataclass
class StepResult:
    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]
    invalid_block_ids: set[int]
    moved: int
    """Bytes this rank's engine has moved so far, as the initiator."""
    verdict: Verdict | None = None


def _apply_fault(fault: str | None) -> None:
    """Checker self-tests: break the worker's offsets, or drop its WRITE, on
    purpose (a rank with a fault runs in a process of its own)."""
    if fault is None:
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector as mc,
    )

    if fault == "shift-remote":
        original = mc.compute_block_transfer_offsets

        def shifted(*args: Any, **kwargs: Any) -> Any:
            local, remote, sizes = original(*args, **kwargs)
            return local, [r + 64 for r in remote], sizes

        mc.compute_block_transfer_offsets = shifted
    elif fault == "shift-local":
        original = mc.compute_block_transfer_offsets

        def shifted_local(*args: Any, **kwargs: Any) -> Any:
            local, remote, sizes = original(*args, **kwargs)
            return [x + 64 for x in local], remote, sizes

        mc.compute_block_transfer_offsets = shifted_local
    elif fault == "swap-heads":
        from dataclasses import replace

        original_mapping = mc.compute_write_tp_mapping

        def swapped(*args: Any, **kwargs: Any) -> Any:
            mapping = original_mapping(*args, **kwargs)
            targets = mapping.targets
            if len(targets) > 1:
                heads = [t.local_head for t in targets]
                targets = tuple(
                    replace(t, local_head=h)
                    for t, h in zip(targets, heads[1:] + heads[:1], strict=True)
                )
            else:
                targets = tuple(
                    replace(t, remote_head=(t.remote_head + t.num_heads) % 2)
                    if t.num_heads
                    else t
                    for t in targets
                )
            return replace(mapping, targets=targets)

        mc.compute_write_tp_mapping = swapped
    elif fault == "drop-write":
        # The prefiller never posts its WRITE: a decoder promised one must
        # report it missing, not judge what it holds.
        def dropped(*args: Any, **kwargs: Any) -> None:
            return None

        mc.MoRIIOConnector.save_kv_layer = dropped
        mc.MoRIIOConnector.wait_for_save = dropped
    else:
        raise ValueError(f"unknown fault {fault!r}")


def _cpu_cuda_shim() -> None:
    """WRITE schedules each layer's write after a CUDA event of the forward
    (``schedule_write_blocks``). The CPU "forward" has finished before the
    hook runs, so the event orders nothing: record and synchronize are
    no-ops. Only the rank's own process sees this."""
    import torch

    class _Event:
        def record(self, stream: Any = None) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

    _CUDA_ORIGINALS.setdefault("current_stream", torch.cuda.current_stream)
    _CUDA_ORIGINALS.setdefault("Event", torch.cuda.Event)
    torch.cuda.current_stream = lambda device=None: None
    torch.cuda.Event = _Event


_CUDA_ORIGINALS: dict[str, Any] = {}
"""What ``_cpu_cuda_shim`` replaced: a process's next rank may be a READ
rank, which gets torch as the zygote imported it."""


def _undo_cuda_shim() -> None:
    import torch

    for name, original in _CUDA_ORIGINALS.items():
        setattr(torch.cuda, name, original)


@dataclass
class _Gather:
    """The rows a judged group's needs pick from each of its layers' pages:
    page and slot of every row, the prefix hash it should hold and the need
    it belongs to (``owner``), for one gather per layer."""

    blocks: Any
    slots: Any
    hashes: Any
    owner: Any
    needs: int
    slot_list: list[Any]
    hash_list: list[np.ndarray]

    @classmethod
    def of(
        cls, blocks: list[int], slots: list[Any], hashes: list[np.ndarray]
    ) -> _Gather:
        counts = [len(s) for s in slots]
        return cls(
            np.repeat(np.asarray(blocks, dtype=np.intp), counts),
            np.concatenate(slots).astype(np.intp),
            np.concatenate(hashes),
            np.repeat(np.arange(len(blocks)), counts),
            len(blocks),
            slots,
            hashes,
        )

    @classmethod
    def none(cls, slots: list[Any], hashes: list[np.ndarray]) -> _Gather:
        """A ring re-viewed in rows of its own: judged page by page."""
        return cls(None, None, None, None, len(slots), slots, hashes)

    def owned(self, per_row: np.ndarray) -> np.ndarray:
        """Per-row counts summed per need."""
        return np.bincount(self.owner, weights=per_row, minlength=self.needs).astype(
            np.int64
        )


class SchedulerEscape(RuntimeError):
    """An exception out of rank 0's ``Scheduler.schedule()`` or
    ``update_from_output()``: in a server it reaches ``EngineCoreProc`` and
    the engine dies. Its text starts with ``ESCAPED`` (the driver counts it
    from the traceback's last line)."""

    @classmethod
    def of(cls, role: str, call: str, exc: BaseException) -> SchedulerEscape:
        leg = "P" if role == "kv_producer" else "D"
        return cls(f"{ESCAPED} {leg} {call}: {type(exc).__name__}: {exc}")


ESCAPED = "escaped"


class Rank:
    """One configuration's rank. A rank process builds one per configuration
    (``open``) and closes it (``close``) before the next, so its process is
    the zygote's fork again, but for leaks that cannot matter (``close``)."""

    def __init__(self, cfg: RankConfig) -> None:
        self.cfg = cfg
        self._built = contextlib.ExitStack()
        """How to undo what ``open`` did to the process, last first."""

    def open(self) -> None:
        cfg = self.cfg
        # The leg's own connector build (a mixed pair: ``simulate/builds.py``).
        use_role(cfg.role)
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorRole,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector import (  # noqa: E501
            MoRIIOConnector,
        )
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
            init_distributed_environment,
            initialize_model_parallel,
        )

        if cfg.open_port is not None:
            os.environ["VLLM_PORT"] = str(cfg.open_port)
        layout = expand([cfg.layout])[0]
        slots = (
            layout.decode_slots if cfg.role == "kv_consumer" else layout.prefill_slots
        )
        options = LegOptions(
            read_mode=cfg.mode == READ,
            tensor_parallel_size=cfg.tp_size,
            kv_cache_layout=cfg.kv_layout,
            model_json=model_json(layout, cfg.geometry),
            specs=lambda: rank_specs(
                layout, cfg.tp_size, cfg.geometry, slots.num_speculative_tokens
            ),
            extra_config={
                "handshake_port": cfg.handshake_port,
                "notify_port": cfg.notify_port,
                "http_port": cfg.notify_port + 10,
                "proxy_ip": "",
                "transfer_timeout": cfg.transfer_timeout,
            },
            with_scheduler=cfg.tp_rank == 0,
            # A case holds two requests at once: the decoder's warm-up, whose
            # blocks stay cached, and the prompt.
            pool_requests=2,
        )
        self.leg = build_leg(
            layout, cfg.role, cfg.handshake_port, cfg.max_model_len, options
        )
        self.vllm_config = self.leg.vllm_config
        self.groups = group_infos(self.leg, layout)
        self._shards = _shards(self.leg, layout, cfg.tp_rank)
        self.scheduler = self.leg.scheduler
        if self.scheduler is not None:
            self._built.callback(self.scheduler.shutdown)
        self._external: dict[str, int] = {}
        if self.scheduler is not None:
            self._spy_external_tokens(self.scheduler.connector)
        self._built.enter_context(set_current_vllm_config(self.vllm_config))
        self._built.callback(destroy_distributed_environment)
        init_distributed_environment(
            world_size=cfg.tp_size,
            rank=cfg.tp_rank,
            distributed_init_method=f"tcp://127.0.0.1:{cfg.dist_port}",
            local_rank=cfg.tp_rank,
            backend="gloo",
        )
        self._built.callback(destroy_model_parallel)
        initialize_model_parallel(cfg.tp_size)
        _apply_fault(cfg.fault)
        if cfg.mode == WRITE:
            self._built.callback(_undo_cuda_shim)
            _cpu_cuda_shim()
        self.connector = MoRIIOConnector(
            self.vllm_config, KVConnectorRole.WORKER, self.leg.worker_config
        )
        self._built.callback(self.connector.shutdown)
        self.worker = self.connector.connector_worker
        # The stand-in's engine: its control plane and completion thread.
        self._built.callback(self.worker.moriio_engine.shutdown)
        self.kv = SharedKV(
            self.leg.worker_config,
            cfg.kv_layout,
            cfg.kv_file or shm_path(os.getpid()),
            canary=0x3C if cfg.role == "kv_producer" else 0xC3,
            zero=0x11 if cfg.role == "kv_producer" else 0,
        )
        self._built.callback(self.kv.close)
        self.connector.register_kv_caches(self.kv.tensors)
        totals = layer_total_heads(layout, cfg.geometry)
        self._heads = {
            name: _heads_of(cfg, view, totals[name])
            for name, view in self.kv.layers.items()
            if self.groups[view.group].kind != STATE_KIND
        }
        self._regions = {
            name: self._state_regions(view)
            for name, view in self.kv.layers.items()
            if self.groups[view.group].kind == STATE_KIND
        }
        self._layer_keys = {name: layer_key(name) for name in self.kv.layers}
        self._page_bytes: dict[int, int] = {}
        self._hashes: dict[str, np.ndarray] = {}
        self._so: Any = None
        self._armed = False
        self._min_bytes = 0
        self._expected: dict[Any, np.ndarray] = {}
        """The watched request's expected attention rows by (layer, needs),
        from its arm to its judge."""
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()
        """``step1``'s ``aggregate`` counts (a leg of one rank)."""

    # -- geometry ----------------------------------------------------------

    def _state_regions(self, view: Any) -> list[tuple[int, int, int, int]]:
        """(region, local byte offset, bytes, first global byte) per region
        of a state page: for a KDA page the conv sub-projections, then the
        recurrent state; for a state of another shape (one short-conv
        array) each state whole, the same on every rank when the spec says
        it is TP-replicated."""
        from math import prod

        from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (  # noqa: E501
            derive_mamba_conv_split,
        )
        from vllm.utils.torch_utils import get_dtype_size

        spec = view.spec
        if len(spec.shapes) != 2:
            regions = []
            offset = 0
            for k, (shape, dtype) in enumerate(
                zip(spec.shapes, spec.dtypes, strict=True)
            ):
                size = prod(shape) * get_dtype_size(dtype)
                first = 0 if spec.tp_replicated else self.cfg.tp_rank * size
                regions.append((k, offset, size, first))
                offset += size
            return regions
        split = derive_mamba_conv_split(spec, self.cfg.tp_size)
        regions = []
        offset = 0
        for k, size in enumerate(split.proj_bytes):
            regions.append((k, offset, size, self.cfg.tp_rank * size))
            offset += size
        conv_bytes = prod(spec.shapes[0]) * get_dtype_size(spec.dtypes[0])
        assert offset == conv_bytes, (offset, conv_bytes)
        ssm = prod(spec.shapes[1]) * get_dtype_size(spec.dtypes[1])
        regions.append((len(split.proj_bytes), offset, ssm, self.cfg.tp_rank * ssm))
        return regions

    def _state_page_bytes(self, view: Any) -> int:
        return sum(size for _, _, size, _ in self._regions[view.name])

    def _group_page_bytes(self, group: int) -> int:
        """Bytes a transfer of one page of ``group`` moves, over its layers."""
        size = self._page_bytes.get(group)
        if size is None:
            layers = self.kv.layers_of(group)
            if self.groups[group].kind == STATE_KIND:
                size = sum(self._state_page_bytes(v) for v in layers)
            else:
                size = sum(v.page_bytes for v in layers)
            self._page_bytes[group] = size
        return size

    def _hash(self, rid: str, tokens: list[int], end: int = 0) -> np.ndarray:
        """Prefix hashes of a request's tokens, at least ``end`` long:
        rows scheduled past the known tokens (speculative padding) hash a
        filler token."""
        need = max(len(tokens), end)
        cached = self._hashes.get(rid)
        if cached is None or len(cached) < need:
            padded = list(tokens) + [-1] * (need - len(tokens))
            cached = prefix_hashes(padded)
            self._hashes[rid] = cached
            while len(self._hashes) > 16:
                del self._hashes[next(iter(self._hashes))]
        return cached

    # -- the "forward" -------------------------------------------------------

    def _write_state(self, view: Any, block: int, h: int | None) -> None:
        self.kv.touch(view, (block,))
        page = view.u8[block].reshape(-1)
        for region, offset, size, first in self._regions[view.name]:
            if h is None:
                page[offset : offset + size] = POISON
            else:
                page[offset : offset + size] = state_bytes(
                    h, self._layer_keys[view.name], region, first, size
                )

    def _state_wrong(self, view: Any, block: int, h: int) -> int:
        page = view.u8[block].reshape(-1)
        wrong = 0
        for region, offset, size, first in self._regions[view.name]:
            expected = state_bytes(h, self._layer_keys[view.name], region, first, size)
            actual = page[offset : offset + size]
            if not same_bytes(actual, expected):
                wrong += int(np.count_nonzero(actual != expected))
        return wrong

    def _attention_wrong(
        self,
        view: Any,
        info: GroupInfo,
        blocks: list[int],
        slots: list[Any],
        hashes: list[np.ndarray],
        expected: dict[Any, np.ndarray],
        key: Any,
    ) -> np.ndarray:
        """Wrong bytes of each page ``blocks[i]``'s rows ``slots[i]`` (which
        should hold the positions of prefix hashes ``hashes[i]``), in one
        gather and one comparison for the layer. The bytes they should hold
        are kept in ``expected`` under ``key``: they depend on the positions
        only, not on the blocks holding them."""
        if info.kind == RING and info.ring_row_bytes:
            return np.array(
                [
                    self._rows_wrong(view, _slot_rows(view, b, info)[:, s, :], h)
                    for b, s, h in zip(blocks, slots, hashes, strict=True)
                ],
                dtype=np.int64,
            )
        gather = _Gather.of(blocks, slots, hashes)
        return gather.owned(self._wrong_rows(view, gather, expected, key))

    def _wrong_rows(
        self, view: Any, gather: _Gather, expected: dict[Any, np.ndarray], key: Any
    ) -> np.ndarray:
        """Wrong bytes of each row ``gather`` picks from ``view``."""
        actual = view.u8[gather.blocks, :, gather.slots, :]
        want = expected.get(key)
        if want is None:
            want = attention_bytes(
                gather.hashes,
                self._layer_keys[view.name],
                self._heads[view.name],
                actual.shape[-1],
                rows_first=True,
            )
            expected[key] = want
        if actual.shape == want.shape and same_bytes(actual, want):
            return np.zeros(len(actual), dtype=np.int64)
        return np.count_nonzero(actual != want, axis=(1, 2))

    def _rows_wrong(self, view: Any, actual: np.ndarray, hashes: np.ndarray) -> int:
        expected = attention_bytes(
            hashes,
            self._layer_keys[view.name],
            self._heads[view.name],
            actual.shape[-1],
        )
        return int(np.count_nonzero(actual != expected))

    def compute(self, item: Compute) -> None:
        hashes = self._hash(item.rid, item.tokens, item.end)
        null = 0
        for g, info in enumerate(self.groups):
            table = item.tables[g]
            bt = info.block_tokens
            layers = self.kv.layers_of(g)
            if info.kind == STATE_KIND:
                idx = -(-item.end // bt) - 1
                if idx >= len(table) or table[idx] == null:
                    continue
                prev = (item.start - 1) // bt
                ok = item.start == 0 or (
                    prev < len(table)
                    and table[prev] != null
                    and all(
                        self._state_wrong(v, table[prev], int(hashes[item.start - 1]))
                        == 0
                        for v in layers
                    )
                )
                h = int(hashes[item.end - 1]) if ok else None
                for view in layers:
                    self._write_state(view, table[idx], h)
                continue
            if info.kind == LOCAL_ONLY:
                continue
            for view in layers:
                written = _rows(
                    _layer_info(info, view),
                    table,
                    item.start,
                    item.end,
                    self._shards[g],
                )
                if info.kind == RING:
                    # One block, whose slots wrap: written in position order.
                    for block, slots, at in written:
                        self.kv.touch(view, (block,))
                        rows = _slot_rows(view, block, info)
                        rows[:, slots, :] = attention_bytes(
                            hashes[at],
                            self._layer_keys[view.name],
                            self._heads[view.name],
                            rows.shape[-1],
                        )
                    continue
                if not written:
                    continue
                # Every page's rows at once: ``[rows, H, C]`` gathered by
                # (block, slot) pairs, written in one scatter.
                blocks = np.concatenate(
                    [np.full(len(slots), block) for block, slots, _ in written]
                ).astype(np.intp)
                slots = np.concatenate([slots for _, slots, _ in written])
                at = np.concatenate([at for _, _, at in written])
                self.kv.touch(view, (block for block, _, _ in written))
                view.u8[blocks, :, slots.astype(np.intp), :] = attention_bytes(
                    hashes[at],
                    self._layer_keys[view.name],
                    self._heads[view.name],
                    view.u8.shape[-1],
                ).transpose(1, 0, 2)

    def _precopy(self, tables: list[list[int]], n: int) -> None:
        """Align-mode state copy of the request's first decoder step, before
        any load (vLLM's ``preprocess_mamba``)."""
        last = n - 1
        if last <= 0:
            return
        for g, info in enumerate(self.groups):
            if info.kind != STATE_KIND:
                continue
            prev, curr = (last - 1) // info.block_tokens, last // info.block_tokens
            table = tables[g]
            if prev != curr and curr < len(table):
                if prev < len(table):
                    self.kv.copy_block(table[prev], table[curr], g)
                else:
                    for view in self.kv.layers_of(g):
                        self.kv.zero_page(view, table[curr])

    # -- the judge -----------------------------------------------------------

    def _needs(
        self,
        watch: Watch,
        tables: list[list[int]],
        lacking: Callable[[Any], bool] | None = None,
    ) -> list[tuple[Any, int, int]]:
        """(need, wrong bytes, bytes a transfer of its page moves) per need.
        A group's attention needs are judged together, one layer at a time
        (``_attention_wrong``). A need for which ``lacking`` is true (the
        decoder lacks its page whatever the page holds) is not read: its
        wrong bytes are given as its page's bytes."""
        hashes = self._hash(watch.rid, watch.tokens)
        all_needs = needs(self.groups, watch.n)
        out: list[tuple[Any, int, int]] = []
        pending: dict[int, list[int]] = {}
        """Group -> indices in ``out`` of its attention needs to judge."""
        for need in all_needs:
            info = self.groups[need.group]
            table = tables[need.group]
            layers = self.kv.layers_of(need.group)
            size = self._group_page_bytes(need.group)
            if (
                need.index >= len(table)
                or table[need.index] == 0
                or (lacking is not None and lacking(need))
            ):
                out.append((need, size, size))
                continue
            block = table[need.index]
            if info.kind == STATE_KIND:
                wrong = sum(
                    self._state_wrong(v, block, int(hashes[need.lo - 1]))
                    for v in layers
                )
                out.append((need, wrong, size))
                continue
            pending.setdefault(need.group, []).append(len(out))
            out.append((need, 0, size))
        for g, indices in pending.items():
            info = self.groups[g]
            group_needs = [out[i][0] for i in indices]
            needs_key = tuple(group_needs)
            blocks = [tables[g][need.index] for need in group_needs]
            wrong = np.zeros(len(indices), dtype=np.int64)
            # Layers whose rows per state agree share their rows: one gather
            # plan per distinct layer geometry, the wrong bytes of its rows
            # summed over its layers before they are counted per need.
            plans: dict[GroupInfo, tuple[_Gather, list[Any]]] = {}
            for v in self.kv.layers_of(g):
                layer_info = _layer_info(info, v)
                plan = plans.get(layer_info)
                if plan is None:
                    rows = [
                        _need_rows(layer_info, need, self._shards[g])
                        for need in group_needs
                    ]
                    need_slots = [slots for slots, _ in rows]
                    need_hashes = [hashes[at] for _, at in rows]
                    if info.kind == RING and info.ring_row_bytes:
                        plan = (_Gather.none(need_slots, need_hashes), [])
                    else:
                        plan = (_Gather.of(blocks, need_slots, need_hashes), [])
                    plans[layer_info] = plan
                gather, sums = plan
                if gather.blocks is None:
                    wrong += self._attention_wrong(
                        v,
                        info,
                        blocks,
                        gather.slot_list,
                        gather.hash_list,
                        self._expected,
                        (v.name, needs_key),
                    )
                    continue
                per_row = self._wrong_rows(
                    v, gather, self._expected, (v.name, needs_key)
                )
                if sums:
                    sums[0] += per_row
                else:
                    sums.append(per_row.astype(np.int64))
            for gather, sums in plans.values():
                if sums:
                    wrong += gather.owned(sums[0])
            for i, w in zip(indices, wrong.tolist(), strict=True):
                need, _, size = out[i]
                out[i] = (need, w, size)
        return out

    def arm(
        self,
        watch: Watch,
        tables: list[list[int]],
        local_hit: int | None,
        plan: StepPlan | None = None,
    ) -> None:
        """Snapshot the buffer but for the transfer's destination pages (the
        judge compares around them and copies them after); the bytes of the
        pages the decoder lacks now are the minimum a transfer must move. A
        page lacks what it holds wrong, or anything past the decoder's local
        hit when that is known (the scheduler simulator's rule,
        ``check.past_hit``): a reallocated block can still hold identical
        bytes the decoder does not own."""
        self.kv.snapshot(skip=self._destination(watch, tables, plan))
        self._armed = True
        self._expected = {}

        def lacking(need: Any) -> bool:
            return past_hit(need, local_hit)

        # A page past the local hit counts whatever it holds: not read.
        needs = self._needs(watch, tables, lacking)
        self._min_bytes = sum(size for _, wrong, size in needs if wrong)

    def judge(
        self, watch: Watch, tables: list[list[int]], plan: StepPlan | None
    ) -> Verdict:
        assert self._armed, "judge before arm"
        verdict = Verdict(min_bytes=self._min_bytes)
        for need, wrong, _ in self._needs(watch, tables):
            if wrong:
                verdict.wrong_needs += 1
                verdict.wrong_bytes += wrong
                if len(verdict.notes) < 3:
                    what = "state" if need.hi == 0 else f"{need.lo}..{need.hi}"
                    verdict.notes.append(
                        f"rank {self.cfg.tp_rank}: group {need.group} page "
                        f"{need.index} ({what}): {wrong} wrong bytes"
                    )
        if plan is not None and not plan.has_sync_kv_loads and watch.dest == "meta":
            meta = plan.metadata.reqs_to_recv.get(watch.rid)
            if meta is not None and any(meta.local_block_ids):
                verdict.late_reads += 1
                verdict.notes.append(
                    f"rank {self.cfg.tp_rank}: READ posted on a step without a "
                    "synchronous load (no external tokens): it lands after the "
                    "forward"
                )
        stray = self.kv.stray_bytes(self._destination(watch, tables, plan))
        verdict.stray_bytes = int(stray.size)
        if stray.size:
            verdict.notes.append(
                f"rank {self.cfg.tp_rank}: {stray.size} bytes written outside the "
                f"destination pages, first at {self._describe(int(stray[0]))}"
            )
        self._armed = False
        self._expected = {}
        return verdict

    def _destination(
        self, watch: Watch, tables: list[list[int]], plan: StepPlan | None
    ) -> list[tuple[Any, int]]:
        """The pages the watched request's transfer may write: a READ's
        ``ReqMeta`` local lists (READ arms and judges in one step), the
        request's table for WRITE (a table only grows from arm to judge)."""
        pages = []
        if watch.dest == "meta":
            assert plan is not None
            meta = plan.metadata.reqs_to_recv.get(watch.rid)
            if meta is not None:
                for g, blocks in zip(
                    plan.payload_groups, meta.local_block_ids, strict=False
                ):
                    pages += [(v, b) for b in blocks for v in self.kv.layers_of(g)]
        else:
            for g, blocks in enumerate(tables):
                pages += [
                    (v, b) for b in blocks if b != 0 for v in self.kv.layers_of(g)
                ]
        return pages

    def _describe(self, offset: int) -> str:
        for view in self.kv.layers.values():
            start = self.kv.page_offset(view, 0)
            stride = view.u8.strides[0]
            block, within = divmod(offset - start, stride)
            if 0 <= block < view.u8.shape[0] and within < view.page_bytes:
                return f"byte {offset} ({view.name} block {block} +{within})"
        return f"byte {offset}"

    # -- one step ------------------------------------------------------------

    def execute(self, plan: StepPlan, watch: Watch | None) -> StepResult:
        self.kv.zero_blocks(plan.zero)
        for src, dst in plan.copies:
            self.kv.copy_block(src, dst)
        tables = plan.tables.get(watch.rid) if watch is not None else None
        judging = watch is not None and watch.judged_in(plan)
        if watch is not None and judging:
            # The request's first decoder step: align-mode state copy first.
            assert tables is not None
            self._precopy(tables, watch.n)
        if watch is not None and watch.arm:
            assert tables is not None
            self.arm(watch, tables, plan.local_hits.get(watch.rid), plan)
        verdict = None
        self.connector.bind_connector_metadata(plan.metadata)
        try:
            if plan.has_sync_kv_loads:
                self.connector.start_load_kv(None)
            if watch is not None and judging:
                assert tables is not None
                verdict = self.judge(watch, tables, plan)
            for item in plan.computes:
                self.compute(item)
            if self.cfg.mode == WRITE and self.cfg.role == "kv_producer":
                for name, view in self.kv.layers.items():
                    if self.groups[view.group].kind != STATE_KIND:
                        self.connector.save_kv_layer(name, view.tensor, None)
            if not plan.has_sync_kv_loads:
                self.connector.start_load_kv(None)
            self.connector.wait_for_save()
            results = self.connector.get_transfer_results(plan.finished_req_ids)
            invalid = self.connector.get_block_ids_with_load_errors()
        finally:
            self.connector.clear_connector_metadata()
        return StepResult(
            set(results.finished_sending or ()),
            set(results.finished_recving or ()),
            set(results.failed_recving or ()),
            set(invalid),
            self.stats(),
            verdict,
        )

    # -- rank 0: the scheduler ---------------------------------------------

    def add(self, rid: str, tokens: list[int], params: dict[str, Any] | None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": params} if params is not None else None
        self.scheduler.add_request(
            Request(
                rid,
                list(tokens),
                SamplingParams(max_tokens=1, ignore_eos=True, extra_args=extra),
                None,
                block_hasher=self.leg.block_hasher,
            )
        )

    def _spy_external_tokens(self, connector: Any) -> None:
        """Note the external token count the scheduler hands the connector."""
        update = connector.update_state_after_alloc

        def spy(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            self._external[request.request_id] = num_external_tokens
            return update(request, blocks, num_external_tokens)

        connector.update_state_after_alloc = spy

    def schedule(self, watch: list[str]) -> StepPlan:
        sched = self.scheduler
        try:
            so = sched.schedule()
        except Exception as exc:
            raise SchedulerEscape.of(self.cfg.role, "schedule()", exc) from exc
        self._so = so
        manager = sched.kv_cache_manager
        computes = []
        for rid, k in so.num_scheduled_tokens.items():
            req = sched.requests[rid]
            end = req.num_computed_tokens
            computes.append(
                Compute(
                    rid,
                    list(req.all_token_ids),
                    end - k,
                    end,
                    [list(t) for t in manager.get_block_ids(rid)],
                )
            )
        tables = {
            rid: [list(t) for t in manager.get_block_ids(rid)]
            for rid in watch
            if rid in sched.requests
        }
        local_hits = {}
        for rid in watch:
            if rid in so.num_scheduled_tokens:
                local_hits[rid] = (
                    sched.requests[rid].num_computed_tokens
                    - so.num_scheduled_tokens[rid]
                    - self._external.pop(rid, 0)
                )
            elif rid in self._external and rid in sched.requests:
                # WRITE: allocated in this step and left waiting for the
                # prefiller's write, not scheduled. Its computed tokens
                # already count the external ones it waits for.
                local_hits[rid] = sched.requests[
                    rid
                ].num_computed_tokens - self._external.pop(rid)
        return StepPlan(
            metadata=so.kv_connector_metadata,
            zero=list(so.new_block_ids_to_zero or []),
            copies=[
                (c.src_block_id, c.dst_block_id) for c in so.kv_cache_block_copies or []
            ],
            computes=computes,
            has_sync_kv_loads=bool(getattr(so, "has_sync_kv_loads", False)),
            finished_req_ids=set(so.finished_req_ids),
            tables=tables,
            local_hits=local_hits,
            payload_groups=self._payload_groups(),
        )

    def _payload_groups(self) -> list[int]:
        return Pair._payload_groups(self.leg)

    def update(
        self, output: dict[str, Any]
    ) -> tuple[list[tuple[str, str | None, Any]], list[str]]:
        """The scheduler's update from the leg's output: each finished
        request's (id, finish reason, ``kv_transfer_params``), and the
        requests the scheduler still holds."""
        from vllm.v1.outputs import KVConnectorOutput

        so = self._so
        sched = self.scheduler
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = sched.requests.get(rid)
            done = req is not None and req.num_computed_tokens >= req.num_tokens
            sampled.append([7] if done else [])
        kv_out = KVConnectorOutput(
            finished_sending=output["finished_sending"] or None,
            finished_recving=output["finished_recving"] or None,
            invalid_block_ids=output["invalid_block_ids"],
            failed_recving=output["failed_recving"],
        )
        out = model_runner_output(
            ids,
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        try:
            outputs = sched.update_from_output(so, out)
        except Exception as exc:
            raise SchedulerEscape.of(
                self.cfg.role, "update_from_output()", exc
            ) from exc
        self._so = None
        outs = [
            (
                o.request_id,
                str(o.finish_reason) if o.finish_reason else None,
                o.kv_transfer_params,
            )
            for eco in outputs.values()
            for o in eco.outputs
        ]
        return outs, list(sched.requests)

    def alive(self, rid: str) -> bool:
        return rid in self.scheduler.requests

    def begin_step(self, add: tuple[Any, ...] | None, watch_ids: list[str]) -> StepPlan:
        """Rank 0: add a request (``add``: ``add``'s arguments), then
        schedule."""
        if add is not None:
            self.add(*add)
        return self.schedule(watch_ids)

    def step1(
        self, add: tuple[Any, ...] | None, watch_ids: list[str], watch: Watch | None
    ) -> tuple[StepResult, dict[str, set[Any]], list[Any], list[str]]:
        """A leg of one rank: schedule, execute and update in one command,
        the rank's output aggregated as the driver does for a wider leg."""
        plan = self.begin_step(add, watch_ids)
        result = self.execute(*_as_sent(plan, watch))
        output = aggregate([result], self._sending, self._recving, 1)
        outs, live = self.update(output)
        return result, output, outs, live

    def reset(self) -> bool:
        return bool(self.scheduler.reset_prefix_cache())

    def stats(self) -> int:
        s = self.worker.moriio_engine.loopback_stats
        return int(s.bytes_read + s.bytes_written)

    def close(self) -> None:
        """Undo ``open``, last first, however far it got: the buffer's file
        emptied and removed, the connectors and the stand-in engine shut
        down, vLLM's parallel state destroyed, the current config and torch
        restored. Raises the first error; every step runs regardless.

        The connector's handshake and notify listeners block in ZMQ on
        contexts of their own, which nothing can reach: their threads stay,
        with their sockets on this configuration's ports and whatever they
        hold (a few objects, no KV memory: the buffer's file is empty). The
        driver retires a process after ``driver.RANK_REUSE`` configurations."""
        self._built.close()


def _as_sent(plan: StepPlan, watch: Watch | None) -> tuple[StepPlan, Watch | None]:
    """``plan`` and ``watch`` as a rank receives them over its pipe: a copy
    through the same pickler, sharing nothing with the scheduler's objects."""
    copied: tuple[StepPlan, Watch | None] = pickle.loads(
        ForkingPickler.dumps((plan, watch))
    )
    return copied


def serve(conn: Any) -> None:
    """Process body: for each ``start``, build that configuration's rank and
    answer its commands until ``release`` (the rank closes and the process
    waits for the next configuration) or ``exit``. A rank that fails to
    build is closed at once; one that fails to close ends the process."""
    while True:
        cmd, args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "release":
            # The configuration's start failed here: closed already.
            conn.send(("ok", None))
            continue
        if cmd != "start":
            conn.send(("error", f"no rank to run {cmd!r}: none started"))
            continue
        rank = Rank(args[0])
        try:
            rank.open()
        except Exception:
            error = traceback.format_exc()
            closed = _close(rank)
            conn.send(("error", error))
            if not closed:
                break
            continue
        conn.send(("ok", None))
        if not _serve_rank(conn, rank):
            break
    sys.stdout.flush()
    os._exit(0)


def _close(rank: Rank) -> bool:
    try:
        rank.close()
    except Exception:
        traceback.print_exc()
        return False
    return True


def _serve_rank(conn: Any, rank: Rank) -> bool:
    """Answer ``rank``'s commands until ``release`` or ``exit``; whether the
    process can take another configuration."""
    commands: dict[str, Callable[..., Any]] = {
        "execute": rank.execute,
        "schedule": rank.schedule,
        "add": rank.add,
        "update": rank.update,
        "alive": rank.alive,
        "reset": rank.reset,
        "step1": rank.step1,
    }
    while True:
        cmd, args = conn.recv()
        if cmd == "exit":
            # The process ends: the driver removes the buffer's file.
            return False
        if cmd == "release":
            closed = _close(rank)
            conn.send(("ok", None) if closed else ("error", "the rank did not close"))
            return closed
        if cmd == "step":
            # Rank 0 of a wider leg: the plan first, for the other ranks,
            # then this rank's result of it.
            add, ids, watch = args
            try:
                plan = rank.begin_step(add, ids)
            except Exception:
                conn.send(("error", traceback.format_exc()))
                continue
            conn.send(("ok", plan))
            try:
                conn.send(("ok", rank.execute(*_as_sent(plan, watch))))
            except Exception:
                conn.send(("error", traceback.format_exc()))
            continue
        try:
            conn.send(("ok", commands[cmd](*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
