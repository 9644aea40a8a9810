"""What the driver and a rank process say to each other over the rank's
pipe: the rank's configuration (``RankConfig``), a step's plan (``StepPlan``:
what vLLM's executor sends a worker), the watched request (``Watch``), a
step's result and the judge's ``Verdict``, and how a leg's results add up
(``aggregate``, as vLLM's ``KVOutputAggregator``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm_overlay.simulate.bytes.geometry import Geometry

READ, WRITE = "read", "write"
ESCAPED = "escaped"
TRANSPORT = "transport-"
"""A fault of the loopback transport itself (``simulate-bytes --faults``):
``transport-`` and a kind of the stand-in's ``FAULT_KINDS``."""
PEER_REFUSALS = (
    "MoRIIO READ cannot serve layer ",
    "MoRIIO READ cannot split the ",
    "MoRIIO WRITE cannot serve ",
)
"""How a leg's connector refuses, at its first handshake, a peer whose TP
size it cannot move a layer or group with: the READ decoder (patch 0032;
a layer's KV heads the two TP sizes cannot split, patch 0027), the WRITE
prefiller (patch 0034)."""
FAULTED_PREFIX = "x"
"""Request ids a transport fault applies to; transfer ids are theirs after a
``t`` (``driver.Driver.run_fault_case``)."""


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
) -> dict[str, Any]:
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
        "worker_meta": _aggregate_meta([r.worker_meta for r in results]),
    }


def _aggregate_meta(metas: list[Any]) -> Any:
    """The ranks' ``KVConnectorWorkerMetadata`` of a step, aggregated as
    vLLM's ``KVOutputAggregator`` does (None when no rank has any)."""
    merged = None
    for meta in metas:
        if meta is not None:
            merged = meta if merged is None else merged.aggregate(meta)
    return merged


@dataclass
class StepResult:
    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]
    invalid_block_ids: set[int]
    moved: int
    """Bytes this rank's engine has moved so far, as the initiator."""
    verdict: Verdict | None = None
    faulted: int = 0
    """Posts a transport fault has failed, left pending or cut short so far
    on this rank's engine."""
    tracked: tuple[int, int] | None = None
    """The tracked (faulted) request's first computed step on this rank:
    (its first computed position, wrong bytes of the pages it attends to
    below that position)."""
    worker_meta: Any = None
    """The connector's ``build_connector_worker_meta()`` of the step."""


class PeerRefused(RuntimeError):
    """A refusal of its peer (``PEER_REFUSALS``) the connector logged instead
    of raising it (a READ decoder recomputes the step's READs from that
    peer): the rank raises it, which refuses the configuration as a raised
    one does."""


class SchedulerEscape(RuntimeError):
    """An exception out of rank 0's ``Scheduler.schedule()`` or
    ``update_from_output()``: in a server it reaches ``EngineCoreProc`` and
    the engine dies. Its text starts with ``ESCAPED`` (the driver counts it
    from the traceback's last line)."""

    @classmethod
    def of(cls, role: str, call: str, exc: BaseException) -> SchedulerEscape:
        leg = "P" if role == "kv_producer" else "D"
        return cls(f"{ESCAPED} {leg} {call}: {type(exc).__name__}: {exc}")
