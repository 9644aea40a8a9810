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

The watched request of a case is judged byte by byte by the rank's
``judge.ByteJudge``: every byte the decoder holds for a position it attends
to, and every byte that changed outside the transfer's destination pages.
This module executes the steps; what crosses the pipe is ``steps.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from vllm_overlay.simulate.builds import use_role
from vllm_overlay.simulate.bytes.content import attention_bytes, global_heads
from vllm_overlay.simulate.bytes.geometry import (
    layer_total_heads,
    model_json,
    rank_specs,
)
from vllm_overlay.simulate.bytes.judge import ByteJudge
from vllm_overlay.simulate.bytes.kvmem import SharedKV
from vllm_overlay.simulate.bytes.rows import (
    NO_SHARD,
    Shard,
    forward_rows,
    layer_info,
    slot_rows,
)
from vllm_overlay.simulate.bytes.shm import shm_path
from vllm_overlay.simulate.bytes.steps import (
    FAULTED_PREFIX,
    PEER_REFUSALS,
    READ,
    TRANSPORT,
    WRITE,
    Compute,
    PeerRefused,
    RankConfig,
    SchedulerEscape,
    StepPlan,
    StepResult,
    Verdict,
    Watch,
    aggregate,
)
from vllm_overlay.simulate.check import LOCAL_ONLY, RING, STATE_KIND
from vllm_overlay.simulate.drive import Pair, group_infos
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.simulate.legs import LegOptions, build_leg
from vllm_overlay.simulate.outputs import model_runner_output


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


def _apply_transport_fault(kind: str, role: str) -> None:
    """Fault the loopback transport's posts for the faulted requests: the
    worker posts a READ's layers from ``_read_blocks`` on the calling thread
    and a WRITE's from its writer's ``_execute_write_task``, so both mark the
    thread with the request they post for. A prefiller that drops out
    (``drop``) also sends nothing more about the faulted transfers. An
    ``abort`` faults no post (the driver aborts the request)."""
    if kind == "abort":
        return
    from mori.io._loopback import TransportFault, posting_for, set_transport_fault
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector as mc,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_engine as me,
    )

    set_transport_fault(TransportFault(kind, FAULTED_PREFIX))
    read_blocks = mc.MoRIIOConnectorWorker._read_blocks

    def read_for(self: Any, *args: Any, **kwargs: Any) -> Any:
        with posting_for(
            str(kwargs.get("request_id", args[3] if len(args) > 3 else ""))
        ):
            return read_blocks(self, *args, **kwargs)

    mc.MoRIIOConnectorWorker._read_blocks = read_for
    execute = me.MoRIIOWriter._execute_write_task

    def write_for(self: Any, task: Any) -> Any:
        with posting_for(str(task.request_id)):
            return execute(self, task)

    me.MoRIIOWriter._execute_write_task = write_for
    if kind == "drop" and role == "kv_producer":
        send_notify = me.MoRIIOWrapper.send_notify

        def silent(self: Any, req_ids: Any, *args: Any, **kwargs: Any) -> Any:
            ids = req_ids if isinstance(req_ids, (list, tuple, set)) else [req_ids]
            if any(str(i).startswith("t" + FAULTED_PREFIX) for i in ids):
                return None
            return send_notify(self, req_ids, *args, **kwargs)

        me.MoRIIOWrapper.send_notify = silent


def _apply_fault(fault: str | None, role: str = "kv_consumer") -> None:
    """Checker self-tests: break the worker's offsets, or drop its WRITE, on
    purpose; or fault the transport (``TRANSPORT``). A rank with a fault
    runs in a process of its own."""
    if fault is None:
        return
    if fault.startswith(TRANSPORT):
        _apply_transport_fault(fault.removeprefix(TRANSPORT), role)
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

        # The overlay maps each layer by its own KV heads (0026).
        name = (
            "compute_layer_write_tp_mapping"
            if hasattr(mc, "compute_layer_write_tp_mapping")
            else "compute_write_tp_mapping"
        )
        original_mapping = getattr(mc, name)

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

        setattr(mc, name, swapped)
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


class _Refusals(logging.Handler):
    """The refusals of a peer (``PEER_REFUSALS``) vLLM's loggers record."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if any(refusal in line for refusal in PEER_REFUSALS):
            self.lines.append(line)


@contextlib.contextmanager
def _logged_refusal_raised() -> Iterator[None]:
    """Raise the first refusal of its peer the connector logged in the
    block (``PeerRefused``)."""
    refusals = _Refusals()
    logger = logging.getLogger("vllm")
    logger.addHandler(refusals)
    try:
        yield
    finally:
        logger.removeHandler(refusals)
    if refusals.lines:
        raise PeerRefused(refusals.lines[0])


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
                **(
                    {
                        "recv_abort_timeout": cfg.transfer_timeout,
                        "defer_timeout": cfg.transfer_timeout,
                        # A WRITE decoder's deadline (past a writer's wait
                        # for a stalled transfer) and quarantine (0043).
                        "write_recv_timeout": 2 * cfg.transfer_timeout,
                        "write_quarantine_timeout": cfg.transfer_timeout,
                    }
                    if cfg.fault and cfg.fault.startswith(TRANSPORT)
                    else {}
                ),
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
        _apply_fault(cfg.fault, cfg.role)
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
        self.judge = ByteJudge(
            cfg.tp_rank,
            cfg.tp_size,
            self.kv,
            self.groups,
            self._shards,
            {
                name: _heads_of(cfg, view, totals[name])
                for name, view in self.kv.layers.items()
                if self.groups[view.group].kind != STATE_KIND
            },
        )
        self._so: Any = None
        self._tracked: str | None = None
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()
        """``step1``'s ``aggregate`` counts (a leg of one rank)."""

    def compute(self, item: Compute) -> None:
        hashes = self.judge.hash(item.rid, item.tokens, item.end)
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
                        self.judge.state_wrong(
                            v, table[prev], int(hashes[item.start - 1])
                        )
                        == 0
                        for v in layers
                    )
                )
                h = int(hashes[item.end - 1]) if ok else None
                for view in layers:
                    self.judge.write_state(view, table[idx], h)
                continue
            if info.kind == LOCAL_ONLY:
                continue
            for view in layers:
                written = forward_rows(
                    layer_info(info, view),
                    table,
                    item.start,
                    item.end,
                    self._shards[g],
                )
                if info.kind == RING:
                    # One block, whose slots wrap: written in position order.
                    for block, slots, at in written:
                        self.kv.touch(view, (block,))
                        rows = slot_rows(view, block, info)
                        rows[:, slots, :] = attention_bytes(
                            hashes[at],
                            self.judge.layer_keys[view.name],
                            self.judge.heads[view.name],
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
                    self.judge.layer_keys[view.name],
                    self.judge.heads[view.name],
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

    def release_watch(self) -> Verdict | None:
        """The armed request is recomputed, not judged (its WRITE failed):
        ``ByteJudge.release``."""
        return self.judge.release()

    def track(self, rid: str | None) -> None:
        """Follow ``rid`` (a faulted request next to the watched one): its
        table's pages are no stray writes of the watched request's transfer,
        and each step that computes it is checked (``StepResult.tracked``)."""
        self._tracked = rid
        self.judge.extra_pages = ()

    def _track_pages(self, plan: StepPlan) -> None:
        """Add the tracked request's pages in ``plan`` to the judge's: a
        block vLLM zeroes in ``plan`` (allocated to it in this step, as a
        recomputed request's new blocks) with every layer's page, as
        ``ByteJudge._destination`` takes the watched request's."""
        table = plan.tables.get(self._tracked or "")
        if table is None:
            return
        pages = list(self.judge.extra_pages)
        known = {(view.name, b) for view, b in pages}
        zeroed = set(plan.zero)
        for g, blocks in enumerate(table):
            for b in blocks:
                views = self.kv.layers.values() if b in zeroed else self.kv.layers_of(g)
                for view in views:
                    if b != 0 and (view.name, b) not in known:
                        known.add((view.name, b))
                        pages.append((view, b))
        self.judge.extra_pages = pages

    def _track_compute(self, plan: StepPlan) -> tuple[int, int] | None:
        """In a step that computes the tracked request, once its loads of
        the step landed: its first computed position and the wrong bytes of
        what it attends to below it (what the decoder treats as loaded or
        computed before).
        vLLM discards a step whose synchronous load failed and computes the
        request again: the last such step is the one that counts."""
        item = next((c for c in plan.computes if c.rid == self._tracked), None)
        if item is None:
            return None
        if item.start == 0:
            return (0, 0)
        n = item.start + 1
        # Align mode: vLLM's model runner copies a state model's state to
        # the block of the request's first computed position, every step.
        self._precopy(item.tables, n)
        below = Watch(item.rid, n, item.tokens[:n])
        return (item.start, self.judge.wrong_bytes(below, item.tables))

    # -- one step ------------------------------------------------------------

    def execute(self, plan: StepPlan, watch: Watch | None) -> StepResult:
        self._track_pages(plan)
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
            self.judge.arm(watch, tables, plan.local_hits.get(watch.rid), plan)
        verdict = None
        self.connector.bind_connector_metadata(plan.metadata)
        try:
            if plan.has_sync_kv_loads:
                with _logged_refusal_raised():
                    self.connector.start_load_kv(None)
            if watch is not None and judging:
                assert tables is not None
                verdict = self.judge.verdict(watch, tables, plan)
            tracked = self._track_compute(plan)
            for item in plan.computes:
                self.compute(item)
            if self.cfg.mode == WRITE and self.cfg.role == "kv_producer":
                for name, view in self.kv.layers.items():
                    if self.groups[view.group].kind != STATE_KIND:
                        self.connector.save_kv_layer(name, view.tensor, None)
            if not plan.has_sync_kv_loads:
                with _logged_refusal_raised():
                    self.connector.start_load_kv(None)
            self.connector.wait_for_save()
            results = self.connector.get_transfer_results(plan.finished_req_ids)
            invalid = self.connector.get_block_ids_with_load_errors()
            worker_meta = self.connector.build_connector_worker_meta()
        finally:
            self.connector.clear_connector_metadata()
        return StepResult(
            set(results.finished_sending or ()),
            set(results.finished_recving or ()),
            set(results.failed_recving or ()),
            set(invalid),
            self.stats(),
            verdict,
            faulted=int(
                getattr(self.worker.moriio_engine.loopback_stats, "faulted_posts", 0)
            ),
            tracked=tracked,
            worker_meta=worker_meta,
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
            for rid in [*watch, *([self._tracked] if self._tracked else [])]
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
            kv_connector_worker_meta=output["worker_meta"],
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

    def handshake_metadata(self) -> bytes | None:
        """The worker's ``get_handshake_metadata()``, pickled as vLLM's
        executor sends it to the engine core (the driver may hold another
        build's classes)."""
        metadata = self.connector.get_handshake_metadata()
        return None if metadata is None else pickle.dumps(metadata)

    def set_handshake_metadata(self, workers: list[bytes | None]) -> None:
        """What vLLM's engine core does after the KV caches are registered,
        before it schedules (``_set_kv_connector_handshake_metadata``): each
        worker's metadata, keyed by (pp_rank, tp_rank), to the scheduler's
        connector. An exception fails the engine's start."""
        content = {
            (0, rank): pickle.loads(metadata)
            for rank, metadata in enumerate(workers)
            if metadata is not None
        }
        self.scheduler.connector.set_xfer_handshake_metadata_pp_aware(content)

    def alive(self, rid: str) -> bool:
        return rid in self.scheduler.requests

    def abort(self, rid: str) -> None:
        """The client aborts ``rid`` (vLLM's ``finish_requests``)."""
        from vllm.v1.request import RequestStatus

        try:
            self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        except Exception as exc:
            raise SchedulerEscape.of(self.cfg.role, "finish_requests()", exc) from exc

    def free_blocks(self) -> int:
        """Blocks in the pool's free queue (cached ones included)."""
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def held_blocks(self) -> int:
        """Blocks the connector holds out of the pool for failed READs still
        in flight (0 for a connector without such a hold)."""
        connector = self.scheduler.connector
        held = getattr(
            getattr(connector, "connector_scheduler", None), "num_held_read_blocks", 0
        )
        return int(held)

    def begin_step(
        self, add: tuple[Any, ...] | list[tuple[Any, ...]] | None, watch_ids: list[str]
    ) -> StepPlan:
        """Rank 0: add a request (``add``: ``add``'s arguments, or a list of
        them: several requests), then schedule."""
        for one in add if isinstance(add, list) else [add] if add else []:
            self.add(*one)
        return self.schedule(watch_ids)

    def step1(
        self, add: tuple[Any, ...] | None, watch_ids: list[str], watch: Watch | None
    ) -> tuple[StepResult, dict[str, Any], list[Any], list[str]]:
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
        "handshake_metadata": rank.handshake_metadata,
        "set_handshake_metadata": rank.set_handshake_metadata,
        "abort": rank.abort,
        "reset": rank.reset,
        "step1": rank.step1,
        "track": rank.track,
        "release_watch": rank.release_watch,
        "free_blocks": rank.free_blocks,
        "held_blocks": rank.held_blocks,
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
