"""READ loads asynchronously where vLLM's scheduler recovers no failed
synchronous load by request (vLLM 0.34.0).

A synchronous READ that failed or hung could only end the engine there: the
request waits in WAITING_FOR_REMOTE_KVS instead, the worker posts its reads
without waiting for them and reports the request in ``finished_recving`` once
every post landed, or in ``failed_recving`` (and ``finished_recving``) once
one failed or the reads outlived ``recv_abort_timeout``: vLLM recomputes it.
The blocks a READ still in flight may write stay held until it ends, also
for a request aborted meanwhile.

The decoder is the real worker on stubbed mori (``build_worker``), its
posts' statuses set by the test; the scheduler side is the real
``MoRIIOConnectorScheduler`` on vLLM's real ``BlockPool``.
"""

from __future__ import annotations

import time
import types
from pathlib import Path
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
    full_and_window_groups,
    glm_like_groups,
    make_kv_cache_config,
    make_leg_connector,
    make_request,
    make_scheduler_connector,
    read_blocks,
)

ASYNC_LOCAL = [[101, 102], [201, 202], [301], [401]]
ASYNC_REMOTE = [[111, 112], [211, 212], [311], [411]]


class PostStatus:
    """A mori transfer status the test sets: ``pending``, ``failed`` or
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


def _async_decoder(vllm_config: Any, state: str) -> tuple[Any, list[PostStatus]]:
    """A READ decoder's worker whose posts get statuses in ``state``; a wait
    for them gives up as mori's does."""
    worker = build_worker(vllm_config, make_kv_cache_config(glm_like_groups()))
    wrapper = worker.moriio_wrapper
    posted: list[PostStatus] = []

    def read_remote_data(*_: Any) -> PostStatus:
        posted.append(PostStatus(state))
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


def test_read_waits_for_remote_kvs(
    mtp_vllm_configs: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The external tokens load asynchronously, unless vLLM's scheduler
    recovers a failed synchronous load (then the forward waits for them)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    connector = make_scheduler_connector(
        mtp_vllm_configs[1], make_kv_cache_config(glm_like_groups())
    )
    request = make_request("x", 64, {"do_remote_prefill": True})
    assert connector.get_num_new_matched_tokens(request, 16) == (47, True)
    monkeypatch.setattr(Scheduler, "recovers_failed_sync_kv_loads", True, raising=False)
    assert connector.get_num_new_matched_tokens(request, 16) == (47, False)
    assert connector.get_num_new_matched_tokens(request, 63) == (0, False)


def test_landed_read_is_reported_received(
    stub_mori: None, mtp_vllm_configs: tuple[Any, Any]
) -> None:
    worker, _ = _async_decoder(mtp_vllm_configs[1], "done")
    try:
        read_blocks(worker, ASYNC_LOCAL, ASYNC_REMOTE, "t-x")
        worker._await_reads_issued_this_step()
        results = worker.get_transfer_results()
        assert results.finished_recving == {"x"}
        assert not results.failed_recving
        assert worker.released == ["t-x"]
    finally:
        worker.shutdown()


@pytest.mark.parametrize("fault", ["error", "hang"])
def test_failed_read_is_reported_without_waiting(
    stub_mori: None, mtp_vllm_configs: tuple[Any, Any], fault: str
) -> None:
    """Nothing waits for the posts before the forward; a failed READ, or
    one past recv_abort_timeout, is reported by request, its prefiller
    released, and (still in flight) its blocks held until it ends."""
    worker, posted = _async_decoder(
        mtp_vllm_configs[1], "failed" if fault == "error" else "pending"
    )
    try:
        read_blocks(worker, ASYNC_LOCAL, ASYNC_REMOTE, "t-x")
        worker._await_reads_issued_this_step()
        if fault == "hang":
            assert worker.get_transfer_results().finished_recving == set()
            worker._recving_transfers_start["x"] = (
                time.monotonic() - 2 * worker.moriio_config.recv_abort_timeout
            )
        results = worker.get_transfer_results()
        meta = worker.build_connector_worker_meta()
        assert results.failed_recving == {"x"}
        assert results.finished_recving == {"x"}
        assert worker.released == ["t-x"]
        if fault == "error":
            assert meta is None
            return
        assert meta.held == {"x": 1}
        for status in posted:
            status.state = "done"
        assert worker.get_transfer_results().finished_recving == set()
        meta = worker.build_connector_worker_meta()
        assert meta.ended == {"x": 1} and not meta.held
    finally:
        worker.shutdown()


def _start_before_handshake(worker: Any, req_ids: list[str]) -> dict[str, Any]:
    """start_load_kv of READs whose prefiller's handshake has not completed
    (started in the background, left pending); their metadata by request."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
        ReqMeta,
    )

    worker._eager_handshake_all_dp_ranks = lambda metadata: set()
    worker._background_moriio_handshake = lambda req_id, engine_id, meta: None
    # A synchronous load waits for the handshake this long first.
    worker.moriio_config.transfer_timeout = 0.0
    metadata = moriio_connector.MoRIIOConnectorMetadata()
    for req_id in req_ids:
        metadata.reqs_to_recv[req_id] = ReqMeta(
            transfer_id=f"t-{req_id}",
            local_block_ids=ASYNC_LOCAL,
            remote_block_ids=ASYNC_REMOTE,
            remote_host="127.0.0.1",
            remote_port=1,
            remote_handshake_port=2,
            remote_notify_port=3,
            remote_engine_id="",
            tp_size=1,
            remote_dp_size=1,
        )
        metadata.transfer_id_to_request_id[f"t-{req_id}"] = req_id
    worker.start_load_kv(metadata)
    return metadata.reqs_to_recv


def _handshake_done(worker: Any, metas: dict[str, Any]) -> None:
    """The background handshake completes: its requests are ready."""
    for req_id, meta in metas.items():
        worker._ready_requests.put((req_id, meta))
        worker.load_ready_flag[meta.remote_engine_id] = True


def test_read_awaiting_its_handshake_fails_after_recv_abort_timeout(
    stub_mori: None, mtp_vllm_configs: tuple[Any, Any]
) -> None:
    """A READ not posted because its prefiller's handshake has not completed
    ends as a failed READ after recv_abort_timeout, its prefiller released;
    a handshake completing later posts nothing into its blocks."""
    worker, posted = _async_decoder(mtp_vllm_configs[1], "done")
    try:
        metas = _start_before_handshake(worker, ["x"])
        assert not posted
        assert worker.get_transfer_results().finished_recving == set()
        worker.moriio_config.recv_abort_timeout = -1.0  # overdue
        results = worker.get_transfer_results()
        assert results.failed_recving == {"x"}
        assert results.finished_recving == {"x"}
        assert worker.released == ["t-x"]
        _handshake_done(worker, metas)
        worker.start_load_kv(moriio_connector.MoRIIOConnectorMetadata())
        assert not posted
        assert worker.get_transfer_results().finished_recving == set()
    finally:
        worker.shutdown()


def test_reads_ready_after_their_handshake_are_all_posted_in_one_step(
    stub_mori: None, mtp_vllm_configs: tuple[Any, Any]
) -> None:
    """Every READ whose handshake completed is posted in the next step,
    whether or not that step names a READ; a post that raises fails its
    request, not the step."""
    worker, posted = _async_decoder(mtp_vllm_configs[1], "done")
    try:
        metas = _start_before_handshake(worker, ["x", "y", "z"])
        assert not posted
        _handshake_done(worker, metas)
        post = worker._read_blocks_for_req

        def post_or_raise(req_id: str, meta: Any) -> None:
            if req_id == "z":
                raise KeyError("no session")
            post(req_id, meta)

        worker._read_blocks_for_req = post_or_raise
        worker.start_load_kv(moriio_connector.MoRIIOConnectorMetadata())
        results = worker.get_transfer_results()
        assert results.finished_recving == {"x", "y", "z"}
        assert results.failed_recving == {"z"}
        assert sorted(worker.released) == ["t-x", "t-y", "t-z"]
    finally:
        worker.shutdown()


def test_aborted_read_in_flight_keeps_its_blocks(
    stub_mori: None, mtp_vllm_configs: tuple[Any, Any]
) -> None:
    """A request aborted while its READ is in flight: vLLM frees its blocks
    once the workers reported it; those the READ may still write stay held."""
    connector = make_scheduler_connector(
        mtp_vllm_configs[1], make_kv_cache_config(glm_like_groups())
    )
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
    connector.bind_gpu_block_pool(pool)
    scheduler = connector.connector_scheduler
    blocks = pool.get_new_blocks(4)
    scheduler._read_dest_blocks["x"] = list(blocks)
    request = make_request("x", 64, {"transfer_id": "t-x"})
    request.status = RequestStatus.FINISHED_ABORTED
    scheduler.request_finished(request, [[b.block_id for b in blocks]])
    connector.update_connector_output(KVConnectorOutput())
    free = pool.get_num_free_blocks()
    connector.update_connector_output(
        KVConnectorOutput(
            finished_recving={"x"},
            failed_recving={"x"},
            kv_connector_worker_meta=moriio_connector.MoRIIOWorkerMetadata(
                held={"x": 1}
            ),
        )
    )
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == free
    assert scheduler.num_held_read_blocks == 4
    connector.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=moriio_connector.MoRIIOWorkerMetadata(
                ended={"x": 1}
            )
        )
    )
    assert pool.get_num_free_blocks() == free + 4


def test_window_pages_end_at_the_loaded_tokens(llama_model_dir: Path) -> None:
    """An asynchronous load's table covers the N-1 tokens it loads: a
    prefiller that computed all N sent one page more, which is not read."""
    connector = make_leg_connector(
        llama_model_dir, "kv_consumer", full_and_window_groups(16, 64)
    )
    scheduler = connector.connector_scheduler
    request = make_request("x", 17, {"do_remote_prefill": True})
    assert scheduler._select_window_pages(request, 1, [5], [7, 8], 17) == ([5], [7])
