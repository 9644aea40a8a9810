"""Patch 0041: a failed or timed-out READ is reported by request, and the
blocks a READ still in flight may write stay held.

READ loads synchronously: the decoder's worker waits for its READs before
the forward. A READ that failed (every post terminal) on a model with
several KV cache groups, or one still in flight when the wait gives up, used
to raise out of ``start_load_kv`` (a real engine dies). Where vLLM's
scheduler recovers a failed synchronous load by request (core patch c006,
``Scheduler.recovers_failed_sync_kv_loads``), the worker now reports the
request in ``failed_recving`` (and ``finished_recving``, as vLLM's output
aggregator requires), releases the prefiller and, while a post is in
flight, has the scheduler side hold the request's destination blocks
(``MoRIIOWorkerMetadata``) until every post ended.

The decoder is the real worker on stubbed mori (``build_worker``), its
posts' statuses set by the test; the scheduler side is the real
``MoRIIOConnectorScheduler`` on vLLM's real ``BlockPool``.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_connector,
    moriio_engine,
)
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    TransferError,
)
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tests.patches.builders import (
    build_worker,
    glm_like_groups,
    make_kv_cache_config,
    make_request,
    make_scheduler_connector,
    read_blocks,
)

LOCAL = [[101, 102], [201, 202], [301], [401]]
REMOTE = [[111, 112], [211, 212], [311], [411]]


class Status:
    """A mori transfer status the test moves: ``pending``, ``failed`` or
    ``done``."""

    def __init__(self, state: str) -> None:
        self.state = state

    def Succeeded(self) -> bool:  # noqa: N802 (mori's method names)
        return self.state == "done"

    def Failed(self) -> bool:  # noqa: N802
        return self.state == "failed"

    def InProgress(self) -> bool:  # noqa: N802
        return self.state == "pending"

    def Code(self) -> int:  # noqa: N802
        return 0 if self.state == "done" else 1

    def Message(self) -> str:  # noqa: N802
        return self.state


@pytest.fixture
def recovering_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's scheduler as core patch c006 makes it."""
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(
        Scheduler, "recovers_failed_sync_kv_loads", True, raising=False
    )


def _decoder(vllm_config: Any, state: str) -> tuple[Any, list[Status]]:
    """A READ decoder's worker whose posts get statuses in ``state``, the
    wait before the forward giving up as mori's does."""
    worker = build_worker(vllm_config, make_kv_cache_config(glm_like_groups()))
    wrapper = worker.moriio_wrapper
    posted: list[Status] = []

    def read_remote_data(*_: Any) -> Status:
        posted.append(Status(state))
        return posted[-1]

    def waiting_for_transfer_complete(statuses: list[Any], **_: Any) -> None:
        if not all(status.Succeeded() for status in statuses):
            raise TransferError("MoRIIO batch wait failed")

    wrapper.read_remote_data = read_remote_data
    wrapper.waiting_for_transfer_complete = waiting_for_transfer_complete
    wrapper.poll_transfer_batch = types.MethodType(
        moriio_engine.MoRIIOWrapper.poll_transfer_batch, wrapper
    )
    released: list[str] = []
    worker._send_read_release = lambda transfer_id, *_: released.append(transfer_id)
    worker.released = released
    return worker, posted


@pytest.mark.parametrize("fault", ["error", "hang"])
def test_failed_read_is_reported_by_request(
    stub_mori: None,
    recovering_scheduler: None,
    mtp_vllm_configs: tuple[Any, Any],
    fault: str,
) -> None:
    worker, posted = _decoder(
        mtp_vllm_configs[1], "failed" if fault == "error" else "pending"
    )
    try:
        read_blocks(worker, LOCAL, REMOTE, "t-x")
        # The wait before the forward gives up: nothing leaves the worker.
        worker._await_reads_issued_this_step()
        results = worker.get_transfer_results()
        meta = worker.build_connector_worker_meta()
        assert results.failed_recving == {"x"}
        assert "x" in results.finished_recving
        assert worker.released == ["t-x"]
        if fault == "error":
            # Every post ended: nothing left to hold.
            assert meta is None
            return
        assert meta.held == {"x": 1} and not meta.ended
        # Reported once; held until every post ends.
        assert worker.get_transfer_results().failed_recving == set()
        assert worker.build_connector_worker_meta() is None
        for status in posted:
            status.state = "done"
        worker.get_transfer_results()
        meta = worker.build_connector_worker_meta()
        assert meta.ended == {"x": 1} and not meta.held
    finally:
        worker.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_blocks_of_a_read_in_flight_stay_out_of_the_pool(
    stub_mori: None, mtp_vllm_configs: tuple[Any, Any], policy: str
) -> None:
    """The scheduler side counts the failed READ and holds its destination
    blocks, still in flight on two decode ranks, until both report it
    ended; a request vLLM failed (kv_load_failure_policy "fail") finished
    before the output reached the connector."""
    connector = make_scheduler_connector(
        mtp_vllm_configs[1], make_kv_cache_config(glm_like_groups())
    )
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
    connector.bind_gpu_block_pool(pool)
    scheduler = connector.connector_scheduler
    blocks = pool.get_new_blocks(4)
    scheduler._read_dest_blocks["x"] = list(blocks)
    # The scheduler freed the request's blocks (it recomputes or fails it).
    if policy == "fail":
        request = make_request("x", 64, {"transfer_id": "t-x"})
        request.status = RequestStatus.FINISHED_ERROR
        scheduler.request_finished(request, [[b.block_id for b in blocks]])
    pool.free_blocks(blocks)
    free = pool.get_num_free_blocks()
    meta_cls = moriio_connector.MoRIIOWorkerMetadata

    def output(**meta: dict[str, int]) -> KVConnectorOutput:
        return KVConnectorOutput(
            failed_recving={"x"} if "held" in meta else set(),
            kv_connector_worker_meta=meta_cls(**meta),
        )

    connector.update_connector_output(output(held={"x": 2}))
    assert pool.get_num_free_blocks() == free - 4
    # The request served without its transfer is counted.
    stats = connector.get_kv_connector_stats()
    assert stats is not None and stats.data["num_fallbacks"] == 1
    assert scheduler.num_held_read_blocks == 4
    connector.update_connector_output(output(ended={"x": 1}))
    assert pool.get_num_free_blocks() == free - 4
    connector.update_connector_output(output(ended={"x": 1}))
    assert pool.get_num_free_blocks() == free
    assert scheduler.num_held_read_blocks == 0

