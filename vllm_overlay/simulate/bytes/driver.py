"""One configuration (layout, mode, TP pair, KV cache layout): fork its ranks,
run prompts through both legs as vLLM's engine core and executor would, and
collect each case's byte verdict.

A case is the scheduler simulator's case (``simulate/drive.py``): an optional
decoder warm-up sharing a prefix of the prompt, then the prompt through the
prefill leg and the decode leg. READ: P prefills and returns its
``kv_transfer_params``; D's first step reads and is judged before its
forward. WRITE: the proxy gives both legs each other's address up front; D
allocates (the destination is snapshotted), P prefills and writes; once every
D rank reported the request received, D's first compute step is judged. A
WRITE for which D's connector counts no external token (a state model at a
full local hit) promises no write: D computes the request in its first step,
judged there, before its forward.
Results from the ranks are aggregated like vLLM's ``KVOutputAggregator``: a
request finished sending or receiving once every rank of the leg said so.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_overlay.simulate.bytes import ports
from vllm_overlay.simulate.bytes.geometry import Geometry
from vllm_overlay.simulate.bytes.lifetime import (
    STOP_SIGNALS,
    die_with_parent,
    stop_signals_blocked,
)
from vllm_overlay.simulate.bytes.rank import serve
from vllm_overlay.simulate.bytes.shm import remove_shm, shm_path
from vllm_overlay.simulate.bytes.steps import (
    ESCAPED,
    FAULTED_PREFIX,
    PEER_REFUSALS,
    READ,
    TRANSPORT,
    RankConfig,
    SchedulerEscape,
    StepResult,
    Verdict,
    Watch,
    aggregate,
)
from vllm_overlay.simulate.drive import prompt_tokens

_REPLY_TIMEOUT = 120.0
_MAX_STEPS = 64
_PORTS = 100
PORT_RANGE = ports.PORT_RANGE
"""Where ``free_port_block`` draws: a sweep gives each of its zygotes its own
part (``ports.port_ranges``)."""
WRITE_WAIT = 30.0
"""Seconds the decoder is stepped for a promised WRITE before the case is an
error ("the decoder never received the WRITE"); the zygote's
``--write-wait``."""


def free_port_block(count: int = _PORTS) -> int:
    """First of ``count`` consecutive loopback ports that are free now, below
    the ephemeral range (the connector's own ``get_open_port`` draws there).
    Ranks add their TP rank to a leg's base ports, as vLLM's workers do."""
    rng = random.Random()
    lo, hi = PORT_RANGE
    for _ in range(200):
        base = rng.randrange(lo, hi - count)
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free loopback ports")


@dataclass(frozen=True)
class Config:
    layout: str
    mode: str
    p_tp: int
    d_tp: int
    kv_layout: str
    fault: str | None = None


class CaseBytes(msgspec.Struct, frozen=True):
    n: int
    hit_fraction: float
    wrong: bool
    wrong_bytes: int = 0
    wrong_needs: int = 0
    stray_bytes: int = 0
    late_reads: int = 0
    moved_bytes: int = 0
    min_bytes: int = 0
    notes: list[str] = []
    error: str | None = None
    escaped: bool = False
    """The error left rank 0's ``Scheduler.schedule()`` or
    ``update_from_output()`` (``rank.SchedulerEscape``)."""
    fault: str | None = None
    """A transport fault case (``run_fault_case``): what became of the
    faulted request on the decoder, ``FAULT_OUTCOMES``."""
    fault_fired: int = 0
    """Posts the transport fault failed, left pending or cut short."""
    held_blocks: int = 0
    """(A fault case.) Decoder blocks the connector holds because the
    faulted READ may still write them (its posts never ended): no leak."""
    leaks: list[str] = []
    """What a fault case left held: ``decoder blocks`` (the decoder's free
    blocks did not come back), ``prefiller blocks`` (the prefiller never
    released a request)."""
    fallback: bool = False
    """(In a fault case: the request next to the faulted one.) The decoder
    got the WRITE as failed (``failed_recving``: the
    prefiller sent ``write_failed``) and its scheduler recomputed the
    request (``kv_load_failure_policy`` "recompute"): nothing of the
    transfer is judged, the request is served without it."""


class RankError(RuntimeError):
    pass


FAULT_OUTCOMES = ("recomputed", "loaded", "aborted", "wrong", "hung")
"""A faulted request on the decoder: computed from before the transfer's
first position (``recomputed``: vLLM's load-failure path), computed from the
transfer's end with every byte it attends to right (``loaded``: the fault
left it nothing to miss), finished without a forward (``aborted``),
computed on a wrong byte (``wrong``), or never finished within
``FAULT_BOUND`` (``hung``)."""
FAULT_TIMEOUT = 2.0
"""The connector's ``transfer_timeout`` (and ``recv_abort_timeout``,
``defer_timeout``) in a transport fault configuration."""
FAULT_BOUND = 8 * FAULT_TIMEOUT + 4
"""Seconds a fault case waits for both its requests on each leg."""


_RANKS: dict[int, Any] = {}
"""This process's rank processes not yet closed, by pid."""


def _rank_main(parent: int, conn: Any) -> None:
    """A forked rank process: it ends with its parent (SIGKILL: the parent,
    or the next sweep, removes its file), leaves SIGINT to its parent, then
    serves one configuration's rank after another."""
    die_with_parent(parent, signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    serve(conn)


_CLOSING: list[tuple[Any, float]] = []
"""Ranks told to exit (or killed) and not reaped yet, each with the time it
is killed if it is still there: a configuration's ranks end while the next
one's start."""

_EXIT_GRACE = 5.0
_AFTER_REFUSAL = 0.05
"""Once a rank of a leg failed to start, how long each other rank of the
leg gets to answer: one that has not is killed, since it may wait for good
on the failed one's rendezvous (a leg's ranks fail alike, but for rank 0's
scheduler)."""


_SLOTS = {"kv_producer": "p", "kv_consumer": "d"}
"""A rank's buffer file is its leg's letter and TP rank (``shm.shm_path``)."""

RANK_REUSE = 16
"""Configurations a rank process serves before it is retired: each leaves
the connector's two listener threads behind (``Rank.close``)."""


@dataclass
class _Proc:
    """A rank process and the driver's end of its pipe."""

    proc: Any
    conn: Any
    configs: int = 0
    """Configurations started in it."""
    releasing: bool = False
    """Told to close its rank; the answer not read yet."""


_IDLE: list[_Proc] = []
"""Rank processes between configurations, oldest release first."""


def _take_idle() -> _Proc | None:
    """An idle process whose rank has closed: the first one closed, waiting
    for one if all are still closing; any that failed to close is retired."""
    while _IDLE:
        closing = {p.conn: p for p in _IDLE if p.releasing}
        if len(closing) < len(_IDLE):
            p = next(p for p in _IDLE if not p.releasing)
            _IDLE.remove(p)
            return p
        ready = multiprocessing.connection.wait(list(closing), _EXIT_GRACE)
        if not ready:
            for p in closing.values():
                _IDLE.remove(p)
                _retire(p, kill=True)
            return None
        for conn in ready:
            p = closing[conn]
            p.releasing = False
            try:
                ok = p.conn.recv()[0] == "ok"
            except (EOFError, OSError):
                ok = False
            if not ok:
                _IDLE.remove(p)
                _retire(p, kill=True)
    return None


def _retire(p: _Proc, kill: bool = False) -> None:
    """Tell the process to exit (``kill``: kill it); ``reap_ranks`` reaps
    it."""
    if kill:
        p.proc.kill()
    else:
        with contextlib.suppress(BrokenPipeError, OSError):
            p.conn.send(("exit", ()))
    _CLOSING.append((p.proc, time.monotonic() + _EXIT_GRACE))


def retire_idle() -> None:
    """Retire every idle process (the zygote's last configuration is done)."""
    while _IDLE:
        _retire(_IDLE.pop())


def kill_ranks() -> None:
    """SIGKILL every rank of this process, reap it and remove its /dev/shm
    file (a rank killed cannot remove it): the zygote's way out on a
    signal."""
    procs = list(_RANKS.values())
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.join(5)
        remove_shm(proc.pid)
    remove_shm(os.getpid())
    _RANKS.clear()
    _CLOSING.clear()
    _IDLE.clear()


def reap_ranks(wait: bool = False) -> None:
    """Reap the closing ranks that ended (``wait``: all of them), killing
    any past its grace, and remove their /dev/shm files."""
    left = []
    for proc, deadline in _CLOSING:
        if wait:
            proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            if not wait and time.monotonic() < deadline:
                left.append((proc, deadline))
                continue
            proc.kill()
            proc.join()
        if proc.pid is not None:
            remove_shm(proc.pid)
            _RANKS.pop(proc.pid, None)
    _CLOSING[:] = left


class _Leg:
    def __init__(
        self, ctx: Any, configs: list[RankConfig], fresh: bool = False
    ) -> None:
        """Start each rank in an idle process (``fresh``: a new one; a rank
        with a fault always gets one) or, when none is idle, a new one
        forked from this process."""
        self.configs = configs
        self.ps: list[_Proc] = []
        target = functools.partial(_rank_main, os.getpid())
        for cfg in configs:
            p = None if fresh or cfg.fault else _take_idle()
            if p is not None:
                try:
                    p.conn.send(("start", (cfg,)))
                except (BrokenPipeError, OSError):  # it died while idle
                    _retire(p, kill=True)
                    p = None
            if p is None:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=target, args=(child,), daemon=True)
                # A signal between the fork and the registration would miss it.
                with stop_signals_blocked():
                    proc.start()
                    _RANKS[proc.pid] = proc
                child.close()
                p = _Proc(proc, parent)
                p.conn.send(("start", (cfg,)))
            p.configs += 1
            self.ps.append(p)
        self.conns = [p.conn for p in self.ps]
        self.procs = [p.proc for p in self.ps]
        self.ready = [False] * len(configs)
        """Which ranks answered their start: a rank that has not may be
        blocked for good (its peer refused the configuration before the TP
        group's rendezvous), so ``close`` kills it instead of waiting."""
        self.pending_sending: Counter[str] = Counter()
        self.pending_recving: Counter[str] = Counter()
        self.moved = [0] * len(configs)
        """Bytes each rank's engine moved, from its latest step."""
        self.live: list[str] | None = None
        """Requests rank 0's scheduler held after the latest step."""

    @property
    def tp(self) -> int:
        return len(self.configs)

    def wait_ready(self) -> None:
        """Every rank's answer to its start; the first error raised once all
        have answered. A rank that fails to start closes and can start
        another configuration; after one fails, the others get
        ``_AFTER_REFUSAL`` seconds."""
        first: RankError | None = None
        for i, conn in enumerate(self.conns):
            if not conn.poll(_REPLY_TIMEOUT if first is None else _AFTER_REFUSAL):
                first = first or RankError("timeout: no reply from a rank")
                continue
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):
                self.procs[i].join(5)
                first = first or RankError(
                    f"a rank process died (exit code {self.procs[i].exitcode})"
                )
                continue
            self.ready[i] = True
            if status != "ok":
                first = first or RankError(payload)
        if first is not None:
            raise first

    def _died(self, conn: Any) -> RankError:
        proc = self.procs[self.conns.index(conn)]
        proc.join(5)
        return RankError(f"a rank process died (exit code {proc.exitcode})")

    def _send(self, conn: Any, cmd: str, args: tuple[Any, ...]) -> None:
        """A command to a rank; a rank whose process is gone (killed, say by
        the kernel's OOM killer) fails the case, as a dead worker fails an
        engine, not the sweep."""
        try:
            conn.send((cmd, args))
        except OSError:  # BrokenPipeError, ConnectionResetError
            raise self._died(conn) from None

    def _reply(self, conn: Any) -> Any:
        if not conn.poll(_REPLY_TIMEOUT):
            raise RankError("timeout: no reply from a rank")
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            raise self._died(conn) from None
        if status != "ok":
            raise RankError(payload)
        return payload

    def call_all(self, cmd: str, *args: Any) -> list[Any]:
        for conn in self.conns:
            self._send(conn, cmd, args)
        return [self._reply(conn) for conn in self.conns]

    def call0(self, cmd: str, *args: Any) -> Any:
        self._send(self.conns[0], cmd, args)
        return self._reply(self.conns[0])

    def step(
        self, watch: Watch | None, add: tuple[Any, ...] | None
    ) -> tuple[list[StepResult], dict[str, Any], list[Any]]:
        """One scheduler step of the leg, as vLLM's engine core drives it:
        rank 0 adds ``add`` (a request) if given, schedules and, alone in its
        leg, also executes and updates the scheduler in the same round trip;
        otherwise it answers the plan, which goes to the other ranks, then
        executes, and the aggregated output goes back to it."""
        ids = [watch.rid] if watch else []
        if self.tp == 1:
            result, output, outs, live = self.call0("step1", add, ids, watch)
            results = [result]
        else:
            conn0 = self.conns[0]
            self._send(conn0, "step", (add, ids, watch))
            plan = self._reply(conn0)
            for conn in self.conns[1:]:
                self._send(conn, "execute", (plan, watch))
            results = [self._reply(conn) for conn in self.conns]
            output = aggregate(
                results, self.pending_sending, self.pending_recving, self.tp
            )
            outs, live = self.call0("update", output)
        for i, r in enumerate(results):
            self.moved[i] = r.moved
        self.live = live
        return results, output, outs

    def close(self, wait: bool = True, reuse: bool = False, kill: bool = False) -> None:
        """``reuse``: tell every rank to close, its process to wait idle for
        the next configuration (one that served ``RANK_REUSE``, or had a
        fault, exits instead); otherwise tell every rank's process to exit
        (``kill``: kill it). A rank that never answered its start is killed.
        Exiting processes are reaped within ``_EXIT_GRACE`` seconds, any left
        killed; ``wait`` False leaves them to a later ``reap_ranks`` (the next
        configuration starts meanwhile)."""
        for p, ready, cfg in zip(self.ps, self.ready, self.configs, strict=True):
            if not ready:
                _retire(p, kill=True)
            elif reuse and cfg.fault is None and p.configs < RANK_REUSE:
                try:
                    p.conn.send(("release", ()))
                except (BrokenPipeError, OSError):
                    _retire(p, kill=True)
                    continue
                p.releasing = True
                _IDLE.append(p)
            else:
                _retire(p, kill=kill)
        if wait:
            reap_ranks(wait=True)


class Driver:
    """The processes of one configuration and the cases run through them."""

    def __init__(
        self,
        config: Config,
        max_model_len: int,
        geometry: Geometry | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.geometry = geometry or Geometry()
        self._ctx = multiprocessing.get_context("fork")
        self._seq = 0
        self._fresh = False
        """Start the ranks in new processes: a case failed on the last."""
        self._last_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        """Requests the decoder reported as failed receives (a WRITE case)."""
        self.p: _Leg | None = None
        self.d: _Leg | None = None

    # -- processes -----------------------------------------------------------

    def start(self) -> None:
        base = free_port_block()
        c = self.config

        def leg(
            role: str, tp: int, hs: int, dist: int, open_port: int
        ) -> list[RankConfig]:
            return [
                RankConfig(
                    layout=c.layout,
                    mode=c.mode,
                    role=role,
                    tp_size=tp,
                    tp_rank=r,
                    kv_layout=c.kv_layout,
                    handshake_port=hs,
                    notify_port=hs + 10,
                    dist_port=dist,
                    max_model_len=self.max_model_len,
                    geometry=self.geometry,
                    fault=c.fault if role == "kv_consumer" or c.mode != READ else None,
                    transfer_timeout=FAULT_TIMEOUT if _transport(c.fault) else 20.0,
                    open_port=open_port + r,
                    kv_file=shm_path(os.getpid(), f"{_SLOTS[role]}{r}"),
                )
                for r in range(tp)
            ]

        # Per leg: handshake, notify and HTTP ports 10 apart (a rank adds its
        # TP rank), then the two legs' torch.distributed rendezvous ports,
        # then each leg's mori engine ports.
        self.p = _Leg(
            self._ctx,
            leg("kv_producer", c.p_tp, base, base + 80, base + 82),
            self._fresh,
        )
        self.d = _Leg(
            self._ctx,
            leg("kv_consumer", c.d_tp, base + 40, base + 81, base + 90),
            self._fresh,
        )
        errors = []
        for started in (self.p, self.d):
            try:
                started.wait_ready()
                # The engine core hands its workers' handshake metadata to
                # the scheduler's connector once they registered their KV.
                started.call0(
                    "set_handshake_metadata", started.call_all("handshake_metadata")
                )
            except RankError as exc:
                errors.append(exc)
        if errors:
            # Refused at start: every rank that answered has closed.
            self.stop(reuse=True)
            raise errors[0]

    def stop(self, reuse: bool = False) -> None:
        """End the configuration's ranks: ``reuse``, their processes wait
        for the next configuration's ranks; otherwise they are killed and
        reaped, since a transfer they still had under way would write into
        the buffer files the next ranks map (``RankConfig.kv_file``)."""
        for leg in (self.p, self.d):
            if leg is not None:
                leg.close(wait=not reuse, reuse=reuse, kill=not reuse)
        self.p = self.d = None
        reap_ranks()

    # -- stepping ------------------------------------------------------------

    def _step(
        self,
        leg: _Leg,
        watch: Watch | None = None,
        add: tuple[Any, ...] | None = None,
    ) -> tuple[list[tuple[str, str | None, Any]], list[Verdict]]:
        results, output, outs = leg.step(watch, add)
        self._last_recv = output["finished_recving"]
        self._failed_recv |= output["failed_recving"]
        verdicts = [r.verdict for r in results if r.verdict is not None]
        return outs, verdicts

    def _until_finished(
        self, leg: _Leg, rid: str, add: tuple[Any, ...] | None = None
    ) -> tuple[str, str | None, Any]:
        for _ in range(_MAX_STEPS):
            outs, _ = self._step(leg, add=add)
            add = None
            for out in outs:
                if out[0] == rid and out[1] is not None:
                    return out
        raise RankError(f"{rid} did not finish")

    def _until_freed(self, leg: _Leg, rid: str) -> None:
        deadline = time.monotonic() + 30
        while leg.call0("alive", rid) if leg.live is None else rid in leg.live:
            if time.monotonic() > deadline:
                raise RankError(f"{rid} was never released on the prefill leg")
            self._step(leg)
            time.sleep(0.001)

    def _moved(self) -> int:
        assert self.p is not None and self.d is not None
        return sum(self.p.moved) + sum(self.d.moved)

    # -- one case ------------------------------------------------------------

    def run_case(self, n: int, hit_fraction: float) -> CaseBytes:
        try:
            if self.p is None:
                self.start()
            if _transport(self.config.fault):
                return self.run_fault_case(n, hit_fraction)
            return self._run_case(n, hit_fraction)
        except RankError as exc:
            # An exception in a worker ends a real engine too: the case's
            # processes go, the next case starts in new ones.
            self.stop()
            self._fresh = True
            error = _first_error(str(exc))
            return CaseBytes(
                n,
                hit_fraction,
                wrong=False,
                error=error,
                escaped=is_escape(error),
            )

    def _run_case(self, n: int, hit_fraction: float) -> CaseBytes:
        assert self.p is not None and self.d is not None
        self._seq += 1
        uid = self._seq
        tokens = prompt_tokens(uid, n)
        rid = f"r{uid}"
        moved = self._moved()
        shared = round(n * hit_fraction)
        if shared > 0:
            warm = prompt_tokens(uid, shared + 1, shared=shared)
            self._until_finished(self.d, f"w{uid}", (f"w{uid}", warm, None))
        if self.config.mode == READ:
            verdicts, recomputed = self._read_case(rid, uid, tokens)
        else:
            verdicts, recomputed = self._write_case(rid, uid, tokens)
        self._until_freed(self.p, rid)
        moved = self._moved() - moved
        if self._seq % 64 == 0:
            self.p.call0("reset")
            self.d.call0("reset")
        case = _case(n, hit_fraction, verdicts, moved)
        return msgspec.structs.replace(case, fallback=True) if recomputed else case

    def _read_case(
        self, rid: str, uid: int, tokens: list[int]
    ) -> tuple[list[Verdict], bool]:
        """The decoder's verdicts, and whether it got the READ as failed and
        recomputed the request (as ``_write_case``). A synchronous load (or
        none) is judged in the decoder's first step, before its forward; an
        asynchronous one in the step that computes the request, once the
        workers reported it loaded."""
        assert self.p is not None and self.d is not None
        p_params = {"do_remote_decode": True, "transfer_id": f"t{uid}"}
        _, _, params = self._until_finished(self.p, rid, (rid, tokens, p_params))
        if not params:
            raise RankError("prefill returned no kv_transfer_params")
        d_params = copy.deepcopy(params)
        d_params["do_remote_prefill"] = True
        n = len(tokens)
        self._failed_recv = set()
        outs, verdicts = self._step(
            self.d,
            Watch(rid, n, tokens, arm=True, dest="table", judge_if_computed=True),
            (rid, tokens, d_params),
        )
        if verdicts:
            if len(verdicts) != self.d.tp:
                raise RankError(f"the decoder judged {rid} on some ranks only")
            if not any(out[0] == rid and out[1] for out in outs):
                self._until_finished(self.d, rid)
            return verdicts, False
        return self._judged_once_received(rid, n, tokens)

    def _write_case(
        self, rid: str, uid: int, tokens: list[int]
    ) -> tuple[list[Verdict], bool]:
        """The decoder's verdicts, and whether it got the WRITE as failed and
        recomputed the request (it must then finish it): then the verdicts
        are of stray bytes only, taken before the recompute
        (``ByteJudge.release``)."""
        assert self.p is not None and self.d is not None
        p_cfg, d_cfg = self.p.configs[0], self.d.configs[0]
        transfer_id = f"t{uid}"
        d_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_host": "127.0.0.1",
            "remote_handshake_port": p_cfg.handshake_port,
            "remote_notify_port": p_cfg.notify_port,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_tp_size": self.p.tp,
            "remote_dp_size": 1,
        }
        p_params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": "127.0.0.1",
            "remote_handshake_port": d_cfg.handshake_port,
            "remote_notify_port": d_cfg.notify_port,
            "remote_tp_size": self.d.tp,
            "remote_dp_size": 1,
        }
        n = len(tokens)
        outs, verdicts = self._step(
            self.d,
            Watch(rid, n, tokens, arm=True, dest="table", judge_if_computed=True),
            (rid, tokens, d_params),
        )
        self._until_finished(self.p, rid, (rid, tokens, p_params))
        if verdicts:
            # The decoder's connector counted no external token (a state
            # model at a full local hit): it asked the prefiller to free its
            # blocks and computed the request at once, judged on what it
            # held for that forward. No WRITE is promised.
            if len(verdicts) != self.d.tp:
                raise RankError(f"the decoder judged {rid} on some ranks only")
            if not any(out[0] == rid and out[1] for out in outs):
                self._until_finished(self.d, rid)
            return verdicts, False
        self._failed_recv = set()
        return self._judged_once_received(rid, n, tokens)

    def _judged_once_received(
        self, rid: str, n: int, tokens: list[int]
    ) -> tuple[list[Verdict], bool]:
        """Step the decoder until its workers report ``rid`` received, then
        judge it in the step that computes it; a failed receive is recomputed
        and judged for stray bytes only."""
        assert self.d is not None
        deadline = time.monotonic() + WRITE_WAIT
        while rid not in self._last_recv:
            if time.monotonic() > deadline:
                mode = "READ" if self.config.mode == READ else "WRITE"
                raise RankError(f"the decoder never received the {mode}")
            self._step(self.d)
            time.sleep(0.002)
        if rid in self._failed_recv:
            released = self._released()
            if len(released) != self.d.tp:
                raise RankError(f"the decoder had not armed {rid} on every rank")
            self._until_finished(self.d, rid)
            return released, True
        return self._judged(Watch(rid, n, tokens, judge=True, dest="table")), False

    def _released(self) -> list[Verdict]:
        """The decoder ranks' ``ByteJudge.release`` of the request they
        armed, where they armed one."""
        assert self.d is not None
        return [v for v in self.d.call_all("release_watch") if v is not None]

    # -- one transport fault case --------------------------------------------

    def _params(self, uid: int, tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The prefiller's and the decoder's ``kv_transfer_params`` of a
        request of transfer ``t{tag}{uid}`` (WRITE: both addresses up front,
        as the toy proxy gives them)."""
        assert self.p is not None and self.d is not None
        transfer_id = f"t{tag}{uid}"
        if self.config.mode == READ:
            return {"do_remote_decode": True, "transfer_id": transfer_id}, {}
        p_cfg, d_cfg = self.p.configs[0], self.d.configs[0]
        common = {
            "transfer_id": transfer_id,
            "remote_host": "127.0.0.1",
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_dp_size": 1,
        }
        p_params = {
            **common,
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_handshake_port": d_cfg.handshake_port,
            "remote_notify_port": d_cfg.notify_port,
            "remote_tp_size": self.d.tp,
        }
        d_params = {
            **common,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_handshake_port": p_cfg.handshake_port,
            "remote_notify_port": p_cfg.notify_port,
            "remote_tp_size": self.p.tp,
        }
        return p_params, d_params

    def run_fault_case(self, n: int, hit_fraction: float) -> CaseBytes:
        """Two requests in flight at once on both legs (no decoder warm-up:
        the sweep runs them at hit 0): ``x{uid}``, whose
        transfer the loopback transport faults (``rank.TRANSPORT``), and
        ``c{uid}``, a different prompt, judged byte by byte as any case's
        request (its pages right, no stray byte outside its and the faulted
        request's pages). The faulted request must reach vLLM's failure path
        or be served right (``FAULT_OUTCOMES``) within ``FAULT_BOUND``, the
        decoder's free blocks come back, and the prefiller release both
        (but after ``drop``: its process is gone)."""
        assert self.p is not None and self.d is not None
        self._seq += 1
        uid = self._seq
        xr, cr = f"{FAULTED_PREFIX}{uid}", f"c{uid}"
        x_tokens = prompt_tokens(uid, n)
        c_tokens = prompt_tokens(uid + (1 << 20), n)
        free_before = self.d.call0("free_blocks")
        held_before = self.d.call0("held_blocks")
        for leg in (self.p, self.d):
            leg.call_all("track", xr)
        xp, xd = self._params(uid, FAULTED_PREFIX)
        cp, cd = self._params(uid, "c")
        fired = 0
        tracked: list[list[tuple[int, int]]] = []
        """Per step computing the faulted request: each rank's check."""
        verdicts: list[Verdict] = []
        deadline = time.monotonic() + FAULT_BOUND

        def step(leg: _Leg, watch: Watch | None = None, add: Any = None) -> list[Any]:
            nonlocal fired
            results, output, outs = leg.step(watch, add)
            self._last_recv = output["finished_recving"]
            self._failed_recv |= output["failed_recving"]
            if leg is self.d:
                checks = [r.tracked for r in results if r.tracked is not None]
                if checks:
                    tracked.append(checks)
                verdicts.extend(r.verdict for r in results if r.verdict is not None)
            fired = max(fired, sum(r.faulted for r in results))
            return outs

        def prefill() -> dict[str, Any]:
            assert self.p is not None
            params: dict[str, Any] = {}
            add: Any = [(xr, x_tokens, xp), (cr, c_tokens, cp)]
            while len(params) < 2:
                if time.monotonic() > deadline:
                    raise RankError("the prefiller did not finish a fault case")
                for rid, reason, kv in step(self.p, add=add):
                    if reason is not None:
                        params[rid] = kv
                add = None
            return params

        self._failed_recv = set()
        if self.config.mode == READ:
            params = prefill()
            adds = []
            for rid, tokens in ((xr, x_tokens), (cr, c_tokens)):
                if not params.get(rid):
                    raise RankError("prefill returned no kv_transfer_params")
                d_params = copy.deepcopy(params[rid])
                d_params["do_remote_prefill"] = True
                adds.append((rid, tokens, d_params))
            step(
                self.d,
                Watch(cr, n, c_tokens, arm=True, dest="table", judge_if_computed=True),
                adds,
            )
        else:
            step(
                self.d,
                Watch(cr, n, c_tokens, arm=True, dest="table", judge_if_computed=True),
                [(xr, x_tokens, xd), (cr, c_tokens, cd)],
            )
            if self.config.fault == TRANSPORT + "abort":
                # The decoder sent the prefiller its pages; no byte moved.
                self.d.call0("abort", xr)
                fired = 1
            prefill()
        # An asynchronous READ may be reported received in its first step.
        judge_next = cr in self._last_recv and cr not in self._failed_recv
        hung = False
        while True:
            live = set(self.d.live or ())
            if xr not in live and cr not in live:
                break
            if time.monotonic() > deadline:
                hung = True
                break
            watch = None
            if not verdicts and judge_next:
                watch = Watch(cr, n, c_tokens, judge=True, dest="table")
            step(self.d, watch)
            if cr in self._last_recv and cr not in self._failed_recv:
                judge_next = True
            time.sleep(0.002)
        # The prefiller may fail the other request's WRITE too (it refuses
        # the pair): recomputed, judged for stray bytes only.
        other_failed = cr in self._failed_recv
        if other_failed and not verdicts and not hung:
            verdicts.extend(self._released())
        if not verdicts and not (hung or other_failed):
            raise RankError(f"the decoder never judged {cr}")
        leaks = []
        held = 0
        if not hung:
            # Blocks a failed READ still in flight may write are held until
            # it ends (the stand-in's hung posts never do): no leak.
            held = self.d.call0("held_blocks") - held_before
            if self.d.call0("free_blocks") + held != free_before:
                leaks.append("decoder blocks")
        # A prefiller that dropped out holds nothing: its process is gone.
        dropped = self.config.fault == TRANSPORT + "drop"
        for rid in (xr, cr):
            p_deadline = time.monotonic() + FAULT_BOUND
            while self.p.call0("alive", rid):
                if time.monotonic() > p_deadline:
                    if not (dropped and rid == xr):
                        leaks.append(f"prefiller blocks of {rid}")
                    break
                step(self.p)
                time.sleep(0.002)
        if hung or leaks:
            # What the case left held would change the next case's pool.
            self.stop()
            self._fresh = True
        else:
            for leg in (self.p, self.d):
                leg.call_all("track", None)
        # The last step that computed it is the one vLLM kept (it discards
        # a step whose synchronous load failed); it was recomputed if any
        # step computed it from before the transfer's end (a preempted
        # request resumes from its own cached blocks).
        last = tracked[-1] if tracked else []
        wrong = sum(w for _, w in last)
        start = min((s for checks in tracked for s, _ in checks), default=None)
        if hung:
            outcome = "hung"
        elif start is None:
            outcome = "aborted"
        elif wrong:
            outcome = "wrong"
        elif start < n - 1:
            outcome = "recomputed"
        else:
            outcome = "loaded"
        case = _case(n, hit_fraction, verdicts, 0) if verdicts else None
        return CaseBytes(
            n,
            hit_fraction,
            wrong=bool(case and case.wrong),
            wrong_bytes=(case.wrong_bytes if case else 0) + wrong,
            stray_bytes=case.stray_bytes if case else 0,
            notes=(case.notes if case else [])
            + ([f"{xr}: computed on {wrong} wrong bytes"] if wrong else []),
            fault=outcome,
            fault_fired=fired,
            held_blocks=held,
            leaks=leaks,
            fallback=other_failed,
        )

    def _judged(
        self, watch: Watch, add: tuple[Any, ...] | None = None
    ) -> list[Verdict]:
        """The request's first decoder step (``add``: the request added
        first), judged on every decoder rank, then its remaining steps."""
        assert self.d is not None
        outs, verdicts = self._step(self.d, watch, add)
        if len(verdicts) != self.d.tp:
            raise RankError(f"the decoder did not schedule {watch.rid}")
        if not any(out[0] == watch.rid and out[1] for out in outs):
            self._until_finished(self.d, watch.rid)
        return verdicts


def _transport(fault: str | None) -> bool:
    return fault is not None and fault.startswith(TRANSPORT)


def is_escape(error: str) -> bool:
    """Whether a case's error (a rank's traceback's last line) is an
    exception that left rank 0's scheduler (``rank.SchedulerEscape``)."""
    return f"{SchedulerEscape.__name__}: {ESCAPED} " in error


def _first_error(text: str) -> str:
    """The last line of a traceback that says something (pydantic ends its
    errors with a link: the line above says what is wrong); a refusal of the
    peer at the handshake from its own words on (the eager handshake's
    wrapper names the peer's address, which changes from case to case)."""
    lines = [
        line.strip()
        for line in text.strip().splitlines()
        if line.strip() and "errors.pydantic.dev" not in line
    ]
    line = lines[-1] if lines else text
    start = max((line.find(refusal) for refusal in PEER_REFUSALS), default=-1)
    return line[max(0, start) :][:300]


def peer_refusal(error: str | None) -> str | None:
    """A leg's refusal of its peer at the handshake, before any byte moved,
    if ``error`` (a case's ``_first_error``) is one."""
    return error if error is not None and error.startswith(PEER_REFUSALS) else None


def _case(n: int, hit: float, verdicts: list[Verdict], moved: int) -> CaseBytes:
    wrong_bytes = sum(v.wrong_bytes for v in verdicts)
    stray = sum(v.stray_bytes for v in verdicts)
    late = sum(v.late_reads for v in verdicts)
    notes = [note for v in verdicts for note in v.notes][:4]
    return CaseBytes(
        n=n,
        hit_fraction=hit,
        wrong=bool(wrong_bytes or stray or late),
        wrong_bytes=wrong_bytes,
        wrong_needs=sum(v.wrong_needs for v in verdicts),
        stray_bytes=stray,
        late_reads=late,
        moved_bytes=moved,
        min_bytes=sum(v.min_bytes for v in verdicts),
        notes=notes,
    )


@dataclass
class ConfigRun:
    config: Config
    cases: list[CaseBytes] = field(default_factory=list)
    refused: str | None = None
    refused_at_start: str | None = None


def run_config(
    config: Config,
    cases: list[tuple[float, int]],
    geometry: Geometry | None = None,
    progress: Any = None,
) -> ConfigRun:
    """The (hit, length) cases of one configuration, in order. A configuration
    vLLM or the connector rejects while the ranks start is refused at start,
    and so is one whose decoder refuses its peer at the first handshake
    (``peer_refusal``: before any byte moves; the case that met it is kept);
    three identical case errors in a row on fresh processes end it too
    (refused)."""
    run = ConfigRun(config)
    driver = Driver(config, max(n for _, n in cases) + 64, geometry)
    streak: list[str] = []
    try:
        try:
            driver.start()
        except RankError as exc:
            # vLLM or the connector refused the configuration while the
            # ranks started: no case can run.
            run.refused_at_start = _first_error(str(exc))
            return run
        for hit, n in cases:
            case = driver.run_case(n, hit)
            run.cases.append(case)
            if progress is not None:
                progress(len(run.cases))
            if case.error is None:
                streak = []
                continue
            if (refusal := peer_refusal(case.error)) is not None:
                run.refused_at_start = refusal
                return run
            streak.append(case.error)
            if len(streak) >= 3 and len(set(streak[-3:])) == 1:
                run.refused = case.error
                return run
    finally:
        driver.stop(reuse=True)
    return run
