"""Drive one prompt through both legs and READ (or WRITE) it page by page.

Order per case: optional decoder warm-up sharing a prefix of the prompt;
prefill on P until it returns ``kv_transfer_params``; the same prompt on D
with those params; D's first step carries the ``ReqMeta`` and the block
table: snapshot what D lacks, READ, check; D samples its token and
finishes; P gets ``finished_sending`` and frees. Each case has tokens of its
own, so earlier cases never give a hit; their pages stay in the pools as
stale contents, and the prefix caches are reset every 64 cases.

WRITE (``Pair(mode="write")``) runs WRITE's order instead, with the same
check (``_run_write_case``; ``writes.py``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec

from vllm_overlay.simulate.builds import CONSUMER, PRODUCER, module_of, use_role
from vllm_overlay.simulate.check import (
    CHUNK,
    FULL,
    LOCAL_ONLY,
    RING,
    STATE_KIND,
    WINDOW,
    CaseResult,
    GroupInfo,
    ReadCheck,
    precopy_states,
    sampled_drafter_rows,
)
from vllm_overlay.simulate.faults import Fault, FaultCase, FaultContext, apply_payload
from vllm_overlay.simulate.hashes import PromptHashes
from vllm_overlay.simulate.layout_types import Layout
from vllm_overlay.simulate.legs import Leg, LegOptions, build_leg
from vllm_overlay.simulate.outputs import model_runner_output
from vllm_overlay.simulate.pages import Page, PageStore, holds_state
from vllm_overlay.simulate.writes import (
    MODES,
    READ,
    WRITE,
    Notified,
    WriteFailed,
    leg_params,
    notified_lists,
    write_done_fails,
    write_done_message,
    write_pairs,
)

Lists = list[list[int]]
RewriteFn = Callable[[Lists, Lists, Lists], tuple[Lists, Lists]]
"""Test hook: (local, remote, decoder tables) -> the (local, remote) to READ."""

_VOCAB = 60000
_STRIDE = 7919
_INVERSE = pow(_STRIDE, -1, _VOCAB)


def prompt_tokens(uid: int, n: int, shared: int = -1, salt: int = 0) -> list[int]:
    """Tokens of prompt ``uid``; positions >= ``shared`` differ (warm-up).

    Token ``i`` is ``(start + 7919 i) % 60000 + 1``, ``start`` depending on
    ``uid`` (and on ``salt`` from ``shared`` on): a run of consecutive
    multiples of 7919 mod 60000, so a slice of one precomputed cycle.
    """
    base = uid * 1_000_003
    if not 0 <= shared < n:
        return _run(base, 0, n)
    return _run(base, 0, shared) + _run(base + 104_729 * (salt + 1), shared, n - shared)


@functools.cache
def _cycle() -> list[int]:
    """``7919 k % 60000 + 1`` for every ``k`` mod 60000."""
    return [_STRIDE * k % _VOCAB + 1 for k in range(_VOCAB)]


def _run(start: int, first: int, count: int) -> list[int]:
    """Tokens ``first .. first + count`` of the sequence starting at ``start``:
    ``(start + 7919 i) % 60000 = 7919 (start / 7919 + i) % 60000``."""
    cycle = _cycle()
    k = (start * _INVERSE + first) % _VOCAB
    out: list[int] = []
    while count > 0:
        take = min(count, _VOCAB - k)
        out += cycle[k : k + take]
        count -= take
        k = 0
    return out


def prompt_tokens_reference(
    uid: int, n: int, shared: int = -1, salt: int = 0
) -> list[int]:
    """``prompt_tokens`` one token at a time: what the tests hold it to."""
    base = uid * 1_000_003
    out = [(base + i * _STRIDE) % _VOCAB + 1 for i in range(n)]
    if 0 <= shared < n:
        alt = base + 104_729 * (salt + 1)
        out[shared:] = [(alt + i * _STRIDE) % _VOCAB + 1 for i in range(shared, n)]
    return out


def group_infos(leg: Leg, layout: Layout) -> list[GroupInfo]:
    """What each KV cache group must hold, from the workers' per-layer specs
    (the scheduler's config keeps only one spec per group)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        MambaSpec,
        SlidingWindowSpec,
        iter_layer_specs,
    )

    config = leg.worker_config or leg.kv_cache_config
    declared = layout.layer_specs()
    out = []
    for g, group in enumerate(config.kv_cache_groups):
        specs = list(iter_layer_specs(group.kv_cache_spec))
        bt, page = leg.group_block_tokens[g], leg.group_page_bytes[g]

        def every(cls: type) -> bool:
            return all(isinstance(s, cls) for s in specs)  # noqa: B023

        if not group.enable_kv_transfer:
            out.append(GroupInfo(LOCAL_ONLY, bt, 0, page))
        elif every(MambaSpec):
            out.append(GroupInfo(STATE_KIND, bt, 0, page))
        elif every(CircularBufferSpec):
            if layout.ring is None:
                raise ValueError(f"{layout.name}: ring group {g} without Ring")
            # The model addresses the ring by its own declared size (or its
            # rank's page in rows); the planner may scale the group's block
            # size up to unify pages.
            size = declared[group.layer_names[0]].block_size
            row_bytes = layout.ring.row_bytes
            rows = specs[0].page_size_bytes // row_bytes if row_bytes else size
            capacity = layout.ring.capacity or rows
            out.append(
                GroupInfo(
                    RING,
                    bt,
                    layout.ring.group_tokens,
                    page,
                    1,
                    capacity,
                    layout.ring.row_bytes,
                )
            )
        elif every(SlidingWindowSpec):
            out.append(GroupInfo(WINDOW, bt, specs[0].sliding_window, page))
        elif every(ChunkedLocalAttentionSpec):
            out.append(GroupInfo(CHUNK, bt, specs[0].attention_chunk_size, page))
        else:
            tps = min(max(1, int(getattr(s, "tokens_per_state", 1))) for s in specs)
            out.append(GroupInfo(FULL, bt, 0, page, tps))
        drafts = sum(
            bool(getattr(declared.get(name), "is_draft", False))
            for name in group.layer_names
        )
        out[-1] = out[-1]._replace(draft_layers=drafts)
    return out


def hand_over_worker_metadata(leg: Leg) -> None:
    """What vLLM's engine core does before it schedules: its workers'
    handshake metadata to the scheduler's connector. No worker connector is
    built here; what its ``get_handshake_metadata`` returns is its build's
    ``_worker_group_states`` on the workers' config (a build without it
    returns none), and on the leg's ``VllmConfig`` where the build takes it:
    its static forward context holds the ring layer objects the model
    registers (``legs.build_ring_layers``), whose group size a worker may
    state (0057)."""
    connector = leg.scheduler.connector
    build = module_of(connector).get("_worker_group_states")
    config = leg.worker_config or leg.kv_cache_config
    metadata = None
    if build is not None:
        takes_vllm_config = len(inspect.signature(build).parameters) > 1
        metadata = (
            build(config, leg.vllm_config) if takes_vllm_config else build(config)
        )
    connector.set_xfer_handshake_metadata_pp_aware(
        {} if metadata is None else {(0, 0): metadata}
    )


def worker_routes(leg: Leg) -> list[int | None]:
    """Payload index each transfer group's layers READ from, per worker.

    Mirrors ``MoRIIOConnectorWorker`` (``__init__`` and ``_read_blocks``) on
    the workers' config with the variant's own ``_split_kv_cache_group_kinds``:
    hybrid READ (any Mamba layer) routes attention layers through
    ``_hybrid_payload_index_by_layer`` and Mamba layers through
    ``_mamba_payload_index_by_layer`` (None: the layer finds no state slot);
    otherwise each layer reads its transfer group's list.
    """
    from vllm.v1.kv_cache_interface import MambaSpec, iter_layer_specs

    config = leg.worker_config or leg.kv_cache_config
    # The leg's own build (a mixed pair loads two: ``builds.py``).
    module = module_of(leg.scheduler.connector)
    groups = config.transfer_groups
    has_mamba = any(
        isinstance(s, MambaSpec)
        for group in groups
        for s in iter_layer_specs(group.kv_cache_spec)
    )
    if not has_mamba:
        return list(range(len(groups)))
    attn, mamba = module["_split_kv_cache_group_kinds"](config)
    order = [*attn, *mamba]
    routes: list[int | None] = []
    for t, group in enumerate(groups):
        layer_is_state = all(
            isinstance(s, MambaSpec) for s in iter_layer_specs(group.kv_cache_spec)
        )
        if layer_is_state and t not in mamba:
            routes.append(None)
        else:
            routes.append(order.index(t))
    return routes


class _AsyncRead(NamedTuple):
    """An asynchronous READ done, to judge when its request is computed."""

    check: ReadCheck
    tables: list[list[int]]
    reads: list[tuple[int, int]]
    null_reads: list[int]
    local_hit: int


class _Refused(Exception):
    """The workers refuse the READ (``_read`` raised); ``__cause__`` says why."""


class Escaped(Exception):
    """An exception out of a leg's ``Scheduler.schedule()`` or
    ``update_from_output()``: in a server it reaches ``EngineCoreProc`` and the
    engine dies with every request in flight. ``__cause__`` is the exception;
    ``site`` says which leg and call (``D schedule()``)."""

    def __init__(self, site: str) -> None:
        super().__init__(site)
        self.site = site


class Pair:
    """A prefill/decode scheduler pair that runs cases one after another.

    A case that fails rebuilds both legs, since the schedulers may be left
    mid-step. A READ the workers refuse is the exception when ``recover``:
    the schedulers are consistent then, so the case runs to its end (the
    decoder computes on, the prefill frees) and reports the refusal; a
    layout whose every READ is refused costs a case, not a rebuild (~1 s),
    per length. ``recover=False`` rebuilds there too (the reference).
    """

    def __init__(
        self,
        layout: Layout,
        max_model_len: int,
        port: int = 40000,
        recover: bool = True,
        mode: str = READ,
    ):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
        self.layout = layout
        self.max_model_len = max_model_len
        self.port = port
        self.recover = recover
        self.mode = mode
        self._build()

    def _build(self) -> None:
        # Each leg on its own build's connector (a mixed pair: ``builds.py``).
        options = LegOptions(read_mode=self.mode == READ)
        use_role(PRODUCER)
        self.p = build_leg(
            self.layout, PRODUCER, self.port, self.max_model_len, options
        )
        use_role(CONSUMER)
        self.d = build_leg(
            self.layout, CONSUMER, self.port + 100, self.max_model_len, options
        )
        hashes = PromptHashes()
        for leg in (self.p, self.d):
            leg.block_hasher = hashes.wrap(leg.block_hasher, leg)
            hand_over_worker_metadata(leg)
        self.groups = group_infos(self.d, self.layout)
        self.p_store = PageStore(self._null_id(self.p))
        self.d_store = PageStore(self._null_id(self.d))
        self.payload_groups = self._payload_groups(self.d)
        transfer_ids = self.d.kv_cache_config.transfer_group_ids
        self.routes = [
            (transfer_ids[t], route) for t, route in enumerate(worker_routes(self.d))
        ]
        self._seq = 0
        self._external: dict[str, int] = {}
        self._prefilled: dict[str, int] = {}
        # Asynchronous READs: read in the step that allocated the request,
        # reported loaded in that step's output, judged when computed.
        self._async_reads: dict[str, _AsyncRead] = {}
        self._received: set[str] = set()
        self._failed: set[str] = set()
        connector = self.d.scheduler.connector
        update = connector.update_state_after_alloc

        def spy(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            self._external[request.request_id] = num_external_tokens
            return update(request, blocks, num_external_tokens)

        connector.update_state_after_alloc = spy
        # Fault mode (``faults.py``): the decoder's count for a request
        # raising.
        self._raises: set[str] = set()
        count = connector.get_num_new_matched_tokens

        def count_spy(request: Any, num_computed_tokens: int) -> Any:
            rid = request.request_id
            if rid in self._raises:
                raise RuntimeError(
                    f"injected: get_num_new_matched_tokens({rid}) raises"
                )
            return count(request, num_computed_tokens)

        connector.get_num_new_matched_tokens = count_spy
        if self.mode == WRITE:
            self._spy_write_notifies()

    @staticmethod
    def _null_id(leg: Leg) -> int:
        return int(leg.scheduler.kv_cache_manager.block_pool.null_block.block_id)

    @staticmethod
    def _payload_groups(leg: Leg) -> list[int]:
        """kv_cache_groups index of each list in the connector's payload."""
        cfg = leg.kv_cache_config
        transfer = [
            next(i for i, g in enumerate(cfg.kv_cache_groups) if g is tg)
            for tg in cfg.transfer_groups
        ]
        conn = leg.scheduler.connector.connector_scheduler
        mamba = list(getattr(conn, "_mamba_group_ids", []))
        if mamba:
            attn = list(conn._attn_group_ids)
            return [transfer[i] for i in (*attn, *mamba)]
        return transfer

    # -- stepping ---------------------------------------------------------

    def _request(self, leg: Leg, rid: str, tokens: list[int], params: Any) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": params} if params is not None else None
        return Request(
            rid,
            list(tokens),
            SamplingParams(max_tokens=1, ignore_eos=True, extra_args=extra),
            None,
            block_hasher=leg.block_hasher,
        )

    def _compute(
        self, leg: Leg, store: PageStore, so: Any, meta: dict[str, tuple[int, int]]
    ) -> None:
        """Write the pages each scheduled request computes in this step."""
        manager = leg.scheduler.kv_cache_manager
        for rid, k in so.num_scheduled_tokens.items():
            if rid not in meta:
                continue
            uid, valid = meta[rid]
            req = leg.scheduler.requests[rid]
            end = req.num_computed_tokens
            start = end - k
            tables = manager.get_block_ids(rid)
            for g, info in enumerate(self.groups):
                table = tables[g]
                bt = info.block_tokens
                if info.kind == LOCAL_ONLY:
                    continue
                if info.kind == RING:
                    if table:
                        store.write_ring(
                            table[0], g, uid, valid, start, end, info.ring_capacity
                        )
                    continue
                if info.kind == STATE_KIND:
                    idx = -(-end // bt) - 1
                    prev = (start - 1) // bt
                    ok = start == 0 or (
                        prev < len(table)
                        and _state_ok(store, table[prev], g, uid, start)
                    )
                    if idx < len(table):
                        store.write_state(table[idx], g, uid if ok else -1, valid, end)
                    continue
                first = start // bt
                last = min((end - 1) // bt, len(table) - 1)
                if first > last:
                    continue
                # The first block may continue a partly written page.
                store.write_positions(
                    table[first], g, uid, valid, start, min(end, (first + 1) * bt)
                )
                pages, null = store.pages, store.null_block_id
                for index in range(first + 1, last + 1):
                    block = table[index]
                    if block != null:
                        pages[block] = Page(
                            g, uid, valid, index * bt, min(end, (index + 1) * bt)
                        )

    def _step(
        self,
        leg: Leg,
        store: PageStore,
        meta: dict[str, tuple[int, int]],
        finished_sending: set[str] | None = None,
        before_compute: Callable[[Any], None] | None = None,
        after_compute: Callable[[Any], None] | None = None,
        finished_recving: set[str] | None = None,
        failed_recving: set[str] | None = None,
    ) -> list[Any]:
        from vllm.v1.outputs import KVConnectorOutput

        sched = leg.scheduler
        site = "P" if leg is self.p else "D"
        _take_role(leg)
        try:
            so = sched.schedule()
        except Exception as exc:
            raise Escaped(f"{site} schedule()") from exc
        # Worker order: zero fresh blocks, apply copy-on-write copies, then
        # (in ``start_load_kv``) READ, then the forward.
        store.zero(list(so.new_block_ids_to_zero or []))
        for copy_op in so.kv_cache_block_copies or []:
            store.put(copy_op.dst_block_id, store.get(copy_op.src_block_id))
        if before_compute is not None:
            before_compute(so)
        self._compute(leg, store, so, meta)
        if after_compute is not None:
            after_compute(so)
        if self._received:
            # Failed ones too, as vLLM's output aggregator hands them over.
            finished_recving = {*(finished_recving or ()), *self._received}
            failed_recving = {*(failed_recving or ()), *self._failed}
            self._received, self._failed = set(), set()
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = sched.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([7] if done else [])
        out = model_runner_output(
            ids,
            sampled_token_ids=sampled,
            kv_connector_output=(
                KVConnectorOutput(
                    finished_sending=finished_sending,
                    finished_recving=finished_recving,
                    failed_recving=failed_recving or set(),
                )
                if finished_sending or finished_recving
                else None
            ),
        )
        try:
            outputs = sched.update_from_output(so, out)
        except Exception as exc:
            raise Escaped(f"{site} update_from_output()") from exc
        return [o for eco in outputs.values() for o in eco.outputs]

    def _run_local(
        self,
        leg: Leg,
        store: PageStore,
        rid: str,
        tokens: list[int],
        uid: int,
        valid: int,
    ) -> None:
        leg.scheduler.add_request(self._request(leg, rid, tokens, None))
        for _ in range(64):
            outs = self._step(leg, store, {rid: (uid, valid)})
            if any(o.request_id == rid and o.finish_reason for o in outs):
                return
        raise RuntimeError(f"local request {rid} did not finish")

    def _next_case(
        self, n: int, hit_fraction: float, held: int | None
    ) -> tuple[int, list[int]]:
        """A new case's id and its prompt; the decoder has computed its
        prefix hit locally already."""
        self._seq += 1
        uid = self._seq
        tokens = prompt_tokens(uid, n)
        shared = round(n * hit_fraction) if held is None else held
        if shared > 0:
            warm = prompt_tokens(uid, shared + 1, shared=shared)
            self._run_local(self.d, self.d_store, f"w{uid}", warm, uid, shared)
        return uid, tokens

    # -- one case ---------------------------------------------------------

    def run_case(
        self,
        n: int,
        hit_fraction: float,
        rewrite: RewriteFn | None = None,
        held: int | None = None,
    ) -> CaseResult:
        """``held``: prompt tokens the decoder holds before the request
        arrives (default ``round(n * hit_fraction)``)."""
        try:
            return self._run_case(n, hit_fraction, rewrite, held)
        except Exception as exc:  # fail-closed refusals and crashes alike
            self._build()
            return _error_result(n, hit_fraction, exc)

    def _run_case(
        self, n: int, hit_fraction: float, rewrite: RewriteFn | None, held: int | None
    ) -> CaseResult:
        if self.mode == WRITE:
            if rewrite is not None:
                raise ValueError("a READ rewrite hook in a WRITE case")
            return self._run_write_case(n, hit_fraction, held)
        uid, tokens = self._next_case(n, hit_fraction, held)

        rid = f"r{uid}"
        params = self._prefill(rid, tokens, uid, n)
        d_params = _copied(params)
        d_params["do_remote_prefill"] = True
        self.d.scheduler.add_request(self._request(self.d, rid, tokens, d_params))
        box: dict[str, CaseResult] = {}
        refused: list[BaseException] = []

        def read_and_check(so: Any) -> None:
            if "result" in box:
                return
            try:
                got = self._read_and_check(so, rid, n, uid, hit_fraction, rewrite)
                if got is not None:
                    box["result"] = got
            except _Refused as exc:
                if not self.recover or exc.__cause__ is None:
                    raise
                refused.append(exc.__cause__)

        def judge_fallback(so: Any) -> None:
            # Served by local prefill: judged once its forward computed
            # the prompt.
            got = box.get("result")
            if got is not None and got.fallback and self._prompt_done(rid, n):
                box["result"] = self._judge_held(rid, n, uid, got)

        meta = {rid: (uid, n)}
        self._step(
            self.d,
            self.d_store,
            meta,
            before_compute=read_and_check,
            after_compute=judge_fallback,
        )
        for _ in range(8):
            if rid not in self.d.scheduler.requests:
                break
            self._step(
                self.d,
                self.d_store,
                meta,
                before_compute=read_and_check,
                after_compute=judge_fallback,
            )
        self._step(self.p, self.p_store, {}, finished_sending={rid})
        if rid in self.p.scheduler.requests:
            raise RuntimeError("prefill did not free the request")
        # Every case has its own tokens, so earlier cases' cached pages are
        # never a hit; they stay evictable, as in a running server. Reset
        # now and then to keep the hash maps small.
        if self._seq % 64 == 0 and not (
            self.p.scheduler.reset_prefix_cache()
            and self.d.scheduler.reset_prefix_cache()
        ):
            raise RuntimeError("reset_prefix_cache refused")
        if refused:
            return _error_result(n, hit_fraction, _Refused(), refused[0])
        if "result" not in box:
            raise RuntimeError("decoder did not schedule the request")
        return box["result"]

    # -- one WRITE case ---------------------------------------------------

    def _spy_write_notifies(self) -> None:
        """WRITE: keep what the decoder's connector sends the prefiller (no
        sockets here): its block lists per transfer, or the release of a
        request it loads nothing for."""
        self._notified: dict[str, tuple[Any, Any]] = {}
        self._released: set[str] = set()
        conn = self.d.scheduler.connector.connector_scheduler

        def notify(
            req_id: str,
            transfer_id: str,
            block_notify_list: Any,
            host: Any = None,
            port: Any = None,
            num_held_blocks: Any = None,
        ) -> None:
            self._notified[transfer_id] = (block_notify_list, num_held_blocks)

        def release(request_id: str, params: Any) -> None:
            self._released.add(request_id)

        conn.send_notify_block = notify
        conn._release_write_prefill_blocks = release

    def _run_write_case(
        self, n: int, hit_fraction: float, held: int | None
    ) -> CaseResult:
        """WRITE's order (as ``bytes/driver.py``): the proxy gives both legs
        each other's address; the decoder allocates (what it lacks is
        snapshotted then) and notifies; the prefiller prefills and writes
        after its forward; the decoder's workers report the request
        received, and its first compute step is judged before the forward.
        A decoder that loads nothing (no external token) computes the
        request in its first step, judged there as READ's."""
        uid, tokens = self._next_case(n, hit_fraction, held)
        rid, transfer_id = f"r{uid}", f"t{uid}"
        p_tp = self.p.vllm_config.parallel_config.tensor_parallel_size
        d_tp = self.d.vllm_config.parallel_config.tensor_parallel_size
        d_params = leg_params(transfer_id, self.port, p_tp, decode=True)
        p_params = leg_params(transfer_id, self.port + 100, d_tp, decode=False)
        self.d.scheduler.add_request(self._request(self.d, rid, tokens, d_params))
        meta = {rid: (uid, n)}
        box: dict[str, Any] = {}

        def allocated(so: Any) -> None:
            if rid in so.num_scheduled_tokens:
                # No external token: computed at once, judged as READ's.
                box["result"] = self._read_and_check(
                    so, rid, n, uid, hit_fraction, None
                )
                return
            req = self.d.scheduler.requests.get(rid)
            if req is None:
                return
            local_hit = req.num_computed_tokens - self._external.pop(rid, 0)
            tables = [
                list(t) for t in self.d.scheduler.kv_cache_manager.get_block_ids(rid)
            ]
            box["local_hit"] = local_hit
            box["check"] = ReadCheck(
                self.groups,
                tables,
                self.d_store,
                n,
                uid,
                local_hit,
                load_before_copy=True,
            )

        def judge_fallback(so: Any) -> None:
            got = box.get("result")
            if got is not None and got.fallback and self._prompt_done(rid, n):
                box["result"] = self._judge_held(rid, n, uid, got)

        self._step(
            self.d,
            self.d_store,
            meta,
            before_compute=allocated,
            after_compute=judge_fallback,
        )
        self._prefill_and_write(rid, transfer_id, tokens, uid, n, p_params, box)

        def judge_write(so: Any) -> None:
            if "result" in box or rid not in so.num_scheduled_tokens:
                return
            box["result"] = self._judge_written(rid, n, hit_fraction, box)

        received = {rid} if "writes" in box or "write_failed" in box else None
        failed = None
        if "write_failed" in box or (
            "writes" in box and self._write_done_fails(transfer_id)
        ):
            # The decoder's workers report the request in failed_recving (and
            # finished_recving); its scheduler recomputes it
            # (kv_load_failure_policy "recompute"), judged after its forward.
            failed = {rid}
            box["result"] = _nothing_read(
                n, hit_fraction, box.get("local_hit", 0), fallback=True
            )
        for _ in range(8):
            if rid not in self.d.scheduler.requests:
                break
            self._step(
                self.d,
                self.d_store,
                meta,
                before_compute=judge_write,
                after_compute=judge_fallback,
                finished_recving=received,
                failed_recving=failed,
            )
            received = failed = None
        self._step(self.p, self.p_store, {}, finished_sending={rid})
        if rid in self.p.scheduler.requests:
            raise RuntimeError("prefill did not free the request")
        self._notified.pop(transfer_id, None)
        self._released.discard(rid)
        if self._seq % 64 == 0 and not (
            self.p.scheduler.reset_prefix_cache()
            and self.d.scheduler.reset_prefix_cache()
        ):
            raise RuntimeError("reset_prefix_cache refused")
        if "result" not in box:
            raise RuntimeError("decoder did not schedule the request")
        result: CaseResult = box["result"]
        return result

    def _prefill_and_write(
        self,
        rid: str,
        transfer_id: str,
        tokens: list[int],
        uid: int,
        n: int,
        params: dict[str, Any],
        box: dict[str, Any],
    ) -> None:
        """Prefill on P until the request finishes; after the forward of the
        step whose ``ReqMeta`` saves it, write into the decoder's pages
        (none when the decoder released the request)."""
        request = self._request(self.p, rid, tokens, params)
        self.p.scheduler.add_request(request)

        def write(so: Any) -> None:
            km = so.kv_connector_metadata
            save = getattr(km, "reqs_to_save", {}).get(rid) if km else None
            if (
                save is None
                or "writes" in box
                or "write_failed" in box
                or rid in self._released
            ):
                return
            if transfer_id not in self._notified:
                raise RuntimeError("the decoder sent the prefiller no block lists")
            self._prefilled[rid] = request.num_prompt_tokens
            try:
                box["writes"] = self._write(transfer_id, save)
            except WriteFailed as exc:
                # The prefiller sends the decoder write_failed (0022).
                box["write_failed"] = str(exc)

        for _ in range(64):
            outs = self._step(
                self.p, self.p_store, {rid: (uid, n)}, after_compute=write
            )
            if any(o.request_id == rid and o.finish_reason for o in outs):
                return
        raise RuntimeError("the prefill did not finish")

    def _write(
        self, transfer_id: str, save: Any
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """Copy the pages the prefiller's workers write (``writes.py``):
        (group, decoder page) per page written, and the group of every pair
        with a null block on either side."""
        raw_lists, held = self._notified[transfer_id]
        notified = Notified(
            notified_lists(raw_lists), list(held) if held is not None else None
        )
        transfer_ids = self.d.kv_cache_config.transfer_group_ids
        module = module_of(self.p.scheduler.connector)
        conn = self.p.scheduler.connector.connector_scheduler
        pairs = write_pairs(
            module.get("MoRIIOWriter"),
            bool(getattr(conn, "_has_mamba", False)),
            [self.groups[g].kind == STATE_KIND for g in transfer_ids],
            [list(x) for x in save.local_block_ids],
            getattr(save, "write_start_blocks", None),
            notified,
        )
        writes: list[tuple[int, int]] = []
        null_writes: list[int] = []
        p_null, d_null = self.p_store.null_block_id, self.d_store.null_block_id
        for t, group_pairs in enumerate(pairs):
            g = transfer_ids[t]
            for src, dst in group_pairs:
                self.d_store.put(dst, self.p_store.get(src))
                writes.append((g, dst))
                if src == p_null or dst == d_null:
                    null_writes.append(g)
        return writes, null_writes

    def _write_done_fails(self, transfer_id: str) -> bool:
        """The prefiller's build's ``write_done`` for ``transfer_id``, taken
        by the decoder's build's real ``MoRIIOWrapper`` as its worker
        configures it: True where it reports the transfer failed."""
        writer = module_of(self.p.scheduler.connector).get("MoRIIOWriter")
        decoder = module_of(self.d.scheduler.connector)
        has_windows = decoder.get("has_window_groups")
        required = has_windows is not None and bool(has_windows(self.d.kv_cache_config))
        _take_role(self.d)
        return write_done_fails(
            decoder["MoRIIOWrapper"],
            required,
            write_done_message(writer, transfer_id),
        )

    def _judge_written(
        self, rid: str, n: int, hit_fraction: float, box: dict[str, Any]
    ) -> CaseResult:
        """The decoder's first compute step after the write: what it holds
        for its last prompt token, the pages written against those it
        lacked when it allocated."""
        check: ReadCheck | None = box.get("check")
        if check is None:
            raise RuntimeError("the decoder scheduled the request before allocating")
        writes, null_writes = box.get("writes", ([], []))
        tables = [list(t) for t in self.d.scheduler.kv_cache_manager.get_block_ids(rid)]
        precopy_states(self.groups, tables, self.d_store, n)
        check.tables = tables
        result = check.judge(
            self.d_store, writes, hit_fraction, box["local_hit"], null_writes
        )
        prefilled = self._prefilled.pop(rid, n)
        sampled = sampled_drafter_rows(self.groups, tables, writes, n, prefilled)
        return msgspec.structs.replace(result, sampled_drafter_rows=sampled)

    def run_fault_case(self, n: int, hit_fraction: float, fault: Fault) -> FaultCase:
        """Two requests on the decoder in one step, one of them meeting
        ``fault`` (``faults.py``). A case that fails rebuilds both legs."""
        try:
            return self._run_fault_case(n, hit_fraction, fault)
        except Exception as exc:
            self._build()
            return FaultCase(
                n,
                hit_fraction,
                escaped=isinstance(exc, Escaped),
                error=error_text(exc)[:300],
            )

    def _run_fault_case(self, n: int, hit_fraction: float, fault: Fault) -> FaultCase:
        self._seq += 2
        uids = {"ok": self._seq - 1, "bad": self._seq}
        rids = {"ok": f"r{uids['ok']}", "bad": f"f{uids['bad']}"}
        tokens = {k: prompt_tokens(uid, n) for k, uid in uids.items()}
        shared = round(n * hit_fraction)
        if shared > 0:
            for k, uid in uids.items():
                warm = prompt_tokens(uid, shared + 1, shared=shared)
                self._run_local(self.d, self.d_store, f"w{k}{uid}", warm, uid, shared)
        d_params = {}
        for k in ("ok", "bad"):
            d_params[k] = _copied(self._prefill(rids[k], tokens[k], uids[k], n))
            d_params[k]["do_remote_prefill"] = True
        ctx = FaultContext(
            [self.groups[g].kind for g in self.payload_groups],
            self.p_store.null_block_id,
        )
        if not apply_payload(fault, d_params["bad"], ctx):
            self._step(self.p, self.p_store, {}, finished_sending=set(rids.values()))
            return FaultCase(n, hit_fraction, injected=False)
        rid_ok, rid_bad = rids["ok"], rids["bad"]
        if fault.raises:
            self._raises.add(rid_bad)
        for k in ("ok", "bad"):
            self.d.scheduler.add_request(
                self._request(self.d, rids[k], tokens[k], d_params[k])
            )
        meta = {rids[k]: (uids[k], n) for k in rids}
        box: dict[str, CaseResult] = {}
        bad_reads = [0]

        def before(so: Any) -> None:
            # The workers READ every request's pages before the forward:
            # the faulty one's first, so a stray copy shows in the other's.
            km = so.kv_connector_metadata
            bad = km.reqs_to_recv.get(rid_bad) if km is not None else None
            if bad is not None and any(bad.local_block_ids):
                reads, _ = self._read(
                    [list(x) for x in bad.local_block_ids],
                    [list(x) for x in bad.remote_block_ids],
                )
                bad_reads[0] += len(reads)
                if rid_bad not in so.num_scheduled_tokens:
                    # An asynchronous load: reported loaded in this step.
                    self._received.add(rid_bad)
            if "ok" not in box:
                got = self._read_and_check(
                    so, rid_ok, n, uids["ok"], hit_fraction, None
                )
                if got is not None:
                    box["ok"] = got

        def after(so: Any) -> None:
            got = box.get("ok")
            if got is not None and got.fallback and self._prompt_done(rid_ok, n):
                box["ok"] = self._judge_held(rid_ok, n, uids["ok"], got)
            if "bad" not in box and self._prompt_done(rid_bad, n):
                blank = _error_result(n, hit_fraction, RuntimeError())
                box["bad"] = self._judge_held(rid_bad, n, uids["bad"], blank)

        for _ in range(16):
            if not (set(rids.values()) & set(self.d.scheduler.requests)):
                break
            self._step(
                self.d, self.d_store, meta, before_compute=before, after_compute=after
            )
        self._external.pop(rid_bad, None)
        self._step(self.p, self.p_store, {}, finished_sending=set(rids.values()))
        ok, bad = box.get("ok"), box.get("bad")
        return FaultCase(
            n,
            hit_fraction,
            other_right=ok is not None and not ok.wrong,
            refused_local=bad is not None and not bad.wrong and bad_reads[0] == 0,
            refused_read=bad_reads[0],
            refused_wrong=bad is not None and bad.wrong,
        )

    def _prefill(self, rid: str, tokens: list[int], uid: int, n: int) -> Any:
        """Prefill ``tokens`` on P until it returns its ``kv_transfer_params``."""
        request = self._request(self.p, rid, tokens, {"do_remote_decode": True})
        self.p.scheduler.add_request(request)
        for _ in range(64):
            for o in self._step(self.p, self.p_store, {rid: (uid, n)}):
                if o.request_id == rid and o.kv_transfer_params:
                    # The prompt the prefiller computed (its connector may
                    # drop trailing tokens for the decoder to recompute).
                    self._prefilled[rid] = request.num_prompt_tokens
                    return o.kv_transfer_params
        raise RuntimeError("prefill returned no kv_transfer_params")

    def _prompt_done(self, rid: str, n: int) -> bool:
        req = self.d.scheduler.requests.get(rid)
        return req is not None and req.num_computed_tokens >= n

    def _judge_held(self, rid: str, n: int, uid: int, got: CaseResult) -> CaseResult:
        """What the decoder holds for ``rid`` after computing its prompt,
        judged by the pages' contents alone."""
        tables = [list(t) for t in self.d.scheduler.kv_cache_manager.get_block_ids(rid)]
        check = ReadCheck(self.groups, tables, self.d_store, n, uid, None)
        # The forward computed the last prompt token too: a state group holds
        # the state after all n tokens (in the block of position n - 1).
        check.needs = [
            need._replace(lo=n) if need.hi == 0 else need for need in check.needs
        ]
        held = check.judge(self.d_store, [], got.hit_fraction, got.local_hit_tokens)
        return msgspec.structs.replace(
            got, wrong=held.wrong, wrong_groups=held.wrong_groups
        )

    def _read_and_check(
        self,
        so: Any,
        rid: str,
        n: int,
        uid: int,
        hit_fraction: float,
        rewrite: RewriteFn | None,
    ) -> CaseResult | None:
        """The READ of ``rid`` in the step of ``so``, judged before its
        forward. An asynchronous load (``rid`` allocated, not scheduled)
        reads in this step and is reported loaded in its output: None, and
        the step that computes it judges it."""
        meta = so.kv_connector_metadata
        req_meta = meta.reqs_to_recv.get(rid) if meta is not None else None
        pending = self._async_reads.pop(rid, None)
        if rid not in so.num_scheduled_tokens:
            if req_meta is None or pending is not None:
                if pending is not None:
                    self._async_reads[rid] = pending
                return None
            self._received.add(rid)
            if rid in meta.reqs_load_failed:
                # Refused after allocation: the workers report its load failed
                # and vLLM recomputes it (judged once computed).
                self._failed.add(rid)
                self._external.pop(rid, None)
                return _nothing_read(n, hit_fraction, 0, fallback=True)
            self._async_reads[rid] = self._read_async(so, rid, n, uid, rewrite)
            return None
        if pending is not None:
            return self._judge_async(so, rid, n, hit_fraction, pending)
        req = self.d.scheduler.requests[rid]
        computed = req.num_computed_tokens - so.num_scheduled_tokens[rid]
        external = self._external.pop(rid, 0)
        local_hit = computed - external
        tables = [list(t) for t in self.d.scheduler.kv_cache_manager.get_block_ids(rid)]
        precopy_states(self.groups, tables, self.d_store, n)
        check = ReadCheck(self.groups, tables, self.d_store, n, uid, local_hit)
        reads: list[tuple[int, int]] = []
        null_reads: list[int] = []
        if (
            external == 0
            and local_hit < n - 1
            and (req_meta is None or not any(req_meta.local_block_ids))
            and rewrite is None
        ):
            # No transfer: the decoder computes the prompt itself
            # (``judge_fallback`` judges it after the forward).
            return _nothing_read(n, hit_fraction, local_hit, fallback=True)
        # vLLM's model runner starts a step's load before the forward only
        # when the step has a synchronous load (a request with external
        # tokens); any other READ lands after the forward.
        late = not getattr(so, "has_sync_kv_loads", True)
        before: CaseResult | None = None
        if req_meta is not None:
            local = [list(x) for x in req_meta.local_block_ids]
            remote = [list(x) for x in req_meta.remote_block_ids]
            if rewrite is not None:
                local, remote = rewrite(local, remote, tables)
            if late and any(local):
                before = check.judge(self.d_store, [], hit_fraction, local_hit)
            try:
                reads, null_reads = self._read(local, remote)
            except RuntimeError as exc:
                raise _Refused() from exc
        # Zeroing a READ destination races the READ: count it as lost.
        read_dsts = {dst for _, dst in reads}
        self.d_store.zero([b for b in so.new_block_ids_to_zero or [] if b in read_dsts])
        result = check.judge(self.d_store, reads, hit_fraction, local_hit, null_reads)
        prefilled = self._prefilled.pop(rid, n)
        sampled = sampled_drafter_rows(self.groups, tables, reads, n, prefilled)
        result = msgspec.structs.replace(result, sampled_drafter_rows=sampled)
        if before is None:
            return result
        # The forward ran on what ``before`` judged; the pages read after it
        # are overwritten.
        wrong_groups = sorted({*before.wrong_groups, *(g for g, _ in reads)})
        return msgspec.structs.replace(
            result, wrong=True, wrong_groups=wrong_groups, late_reads=len(reads)
        )

    def _read_async(
        self, so: Any, rid: str, n: int, uid: int, rewrite: RewriteFn | None
    ) -> _AsyncRead:
        """Read the pages of an asynchronous load (its request allocated in
        the step of ``so``, not computed there), what it lacked noted first."""
        req = self.d.scheduler.requests[rid]
        local_hit = req.num_computed_tokens - self._external.pop(rid, 0)
        tables = [list(t) for t in self.d.scheduler.kv_cache_manager.get_block_ids(rid)]
        check = ReadCheck(
            self.groups, tables, self.d_store, n, uid, local_hit, load_before_copy=True
        )
        req_meta = so.kv_connector_metadata.reqs_to_recv[rid]
        local = [list(x) for x in req_meta.local_block_ids]
        remote = [list(x) for x in req_meta.remote_block_ids]
        if rewrite is not None:
            local, remote = rewrite(local, remote, tables)
        try:
            reads, null_reads = self._read(local, remote)
        except RuntimeError as exc:
            raise _Refused() from exc
        return _AsyncRead(check, tables, reads, null_reads, local_hit)

    def _judge_async(
        self, so: Any, rid: str, n: int, hit_fraction: float, pending: _AsyncRead
    ) -> CaseResult:
        """Judge an asynchronous load in the step that computes its request,
        before the forward (after the align-mode state copy), on that step's
        tables: a state group's table grew by the block of position N-1."""
        tables = [list(t) for t in self.d.scheduler.kv_cache_manager.get_block_ids(rid)]
        precopy_states(self.groups, tables, self.d_store, n)
        pending.check.tables = tables
        result = pending.check.judge(
            self.d_store,
            pending.reads,
            hit_fraction,
            pending.local_hit,
            pending.null_reads,
        )
        prefilled = self._prefilled.pop(rid, n)
        sampled = sampled_drafter_rows(
            self.groups, pending.tables, pending.reads, n, prefilled
        )
        return msgspec.structs.replace(result, sampled_drafter_rows=sampled)

    def _read(
        self, local: Sequence[list[int]], remote: Sequence[list[int]]
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """Copy pages as the workers' ``_read_blocks`` pairs them.

        No local destination at all means no READ (the worker only releases
        the producer); otherwise each group's layers zip the lists of the
        payload index the worker routes them to (``worker_routes``).
        Returns (group, destination) per page copied and the group of every
        pair whose source is the prefiller's null block or whose destination
        is the decoder's.
        """
        if not any(local):
            return [], []
        if len(local) != len(remote) or len(local) != len(self.payload_groups):
            raise RuntimeError(
                f"ReqMeta group count mismatch: local={len(local)} "
                f"remote={len(remote)} payload={len(self.payload_groups)}"
            )
        reads = []
        null_reads = []
        p_null, d_null = self.p_store.null_block_id, self.d_store.null_block_id
        for g, route in self.routes:
            if route is None:
                raise RuntimeError(
                    f"worker: the state layers of group {g} have no payload list "
                    "(MoRIIOError in _read_blocks)"
                )
            for dst, src in zip(local[route], remote[route], strict=False):
                self.d_store.put(dst, self.p_store.get(src))
                reads.append((g, dst))
                if src == p_null or dst == d_null:
                    null_reads.append(g)
        return reads, null_reads


def _take_role(leg: Leg) -> None:
    """The connector's process-wide role (``moriio_common.set_role``; its
    WRITE save path asks ``get_role()``) is the leg's own while it steps:
    a server runs one leg per process, this one runs both."""
    module = module_of(leg.scheduler.connector)
    set_role, role = module.get("set_role"), module.get("ROLE")
    if set_role is not None and role is not None:
        set_role(role.PRODUCER if leg.role == PRODUCER else role.CONSUMER)


def _copied(value: Any) -> Any:
    """A copy of JSON-like ``kv_transfer_params``: dicts and lists are new,
    the leaves (str, int, bool, None) shared."""
    if isinstance(value, dict):
        return {
            k: _copied(v) if isinstance(v, dict | list) else v for k, v in value.items()
        }
    if isinstance(value, list):
        return [_copied(v) if isinstance(v, dict | list) else v for v in value]
    return value


def error_text(exc: BaseException, cause: BaseException | None = None) -> str:
    """One line for a case's error: an escape says where it escaped."""
    cause = cause or exc.__cause__
    if isinstance(exc, Escaped) and cause is not None:
        return f"escaped {exc.site}: {type(cause).__name__}: {cause}"
    if isinstance(exc, _Refused) and cause is not None:
        exc = cause
    return f"{type(exc).__name__}: {exc}"


def _nothing_read(
    n: int, hit_fraction: float, local_hit_tokens: int, **fields: Any
) -> CaseResult:
    """A case in which the decoder read nothing: ``fields`` say why."""
    return CaseResult(
        n=n,
        hit_fraction=hit_fraction,
        local_hit_tokens=local_hit_tokens,
        wrong=False,
        wrong_groups=[],
        pages_read=0,
        min_pages=0,
        bytes_read=0,
        min_bytes=0,
        extra_reads=0,
        duplicate_reads=0,
        unread=0,
        **fields,
    )


def _error_result(
    n: int, hit_fraction: float, exc: BaseException, cause: BaseException | None = None
) -> CaseResult:
    return _nothing_read(
        n,
        hit_fraction,
        0,
        error=error_text(exc, cause)[:300],
        escaped=isinstance(exc, Escaped),
    )


def _state_ok(store: PageStore, block_id: int, group: int, uid: int, t: int) -> bool:
    return holds_state(store.get(block_id), group, uid, t)
