"""A READ decoder whose eager handshake with a prefiller failed, on any TP
rank, fails that prefiller's READs of the step by request instead of
raising out of ``start_load_kv`` (a real engine dies, with every request in
flight, those of healthy prefillers too).

Every TP rank takes the same verdict from the all-reduce vote and fails the
same requests: each is reported in ``failed_recving`` (and
``finished_recving``) once, its prefiller released, and vLLM recomputes it;
one ERROR line names the prefiller and the first reason. The READs of
another prefiller are posted as before, and the failed prefiller is
handshaked again for a later request.

The decoder is the real worker on stubbed mori (``build_worker``), its
handshakes and the TP vote set by the test.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_connector,
    moriio_engine,
)
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    HandshakeError,
    ReqMeta,
)

from tests.patches.builders import (
    WarningRecords,
    build_worker,
    glm_like_groups,
    make_kv_cache_config,
)

LOCAL = [[101, 102], [201, 202], [301], [401]]
REMOTE = [[111, 112], [211, 212], [311], [411]]
FAILING_PORT = 2
HEALTHY_PORT = 4
REASON = "MoRIIO READ cannot serve layer model.layers.0.short_conv"


class Done:
    """A mori transfer status that landed."""

    def Succeeded(self) -> bool:  # noqa: N802 (mori's method names)
        return True

    def Failed(self) -> bool:  # noqa: N802
        return False

    def InProgress(self) -> bool:  # noqa: N802
        return False


def _decoder(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch, other_rank_fails: bool
) -> Any:
    """A READ decoder's worker, one of a TP group whose vote is MIN over this
    rank and one more (failing its handshakes or not); its handshakes with
    the prefiller on FAILING_PORT fail on this rank unless another rank's do."""
    worker = build_worker(vllm_config, make_kv_cache_config(glm_like_groups()))
    wrapper = worker.moriio_wrapper
    posted: list[str] = []

    def read_remote_data(*_: Any) -> Done:
        posted.append("read")
        return Done()

    wrapper.read_remote_data = read_remote_data
    wrapper.waiting_for_transfer_complete = lambda *_, **__: None
    wrapper.poll_transfer_batch = types.MethodType(
        moriio_engine.MoRIIOWrapper.poll_transfer_batch, wrapper
    )
    released: list[str] = []
    worker._send_read_release = lambda transfer_id, *_: released.append(transfer_id)
    handshakes: list[int] = []

    def handshake(host, port, tp_size, eid, dp, tp):
        handshakes.append(port)
        if port == FAILING_PORT and not other_rank_fails:
            raise HandshakeError(REASON)
        return {eid}

    def all_reduce(vote: torch.Tensor, **_: Any) -> None:
        if other_rank_fails and handshakes[-1:] == [FAILING_PORT]:
            vote.fill_(0)

    worker._moriio_handshake = handshake
    worker.tp_group = types.SimpleNamespace(cpu_group=None)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    worker.posted, worker.released, worker.handshakes = posted, released, handshakes
    return worker


def _metadata(reqs: dict[str, int]) -> Any:
    """A step's metadata: each request READs from the prefiller on its port."""
    metadata = moriio_connector.MoRIIOConnectorMetadata()
    for req_id, port in reqs.items():
        metadata.reqs_to_recv[req_id] = ReqMeta(
            transfer_id=f"t-{req_id}",
            local_block_ids=LOCAL,
            remote_block_ids=REMOTE,
            remote_host="127.0.0.1",
            remote_port=1,
            remote_handshake_port=port,
            remote_notify_port=3,
            remote_engine_id="",
            tp_size=1,
            remote_dp_size=1,
        )
        metadata.transfer_id_to_request_id[f"t-{req_id}"] = req_id
    return metadata


@pytest.fixture(params=["asynchronous", "synchronous"])
def load(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """READ loads asynchronously (vLLM 0.34.0), or synchronously where vLLM's
    scheduler recovers a failed synchronous load (core patch c006)."""
    if request.param == "synchronous":
        from vllm.v1.core.sched.scheduler import Scheduler

        monkeypatch.setattr(
            Scheduler, "recovers_failed_sync_kv_loads", True, raising=False
        )
    return request.param


@pytest.mark.parametrize("failing", ["this-rank", "other-rank"])
def test_failed_handshake_fails_its_reads_by_request(
    stub_mori: None,
    mtp_vllm_configs: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
    load: str,
    failing: str,
) -> None:
    worker = _decoder(mtp_vllm_configs[1], monkeypatch, failing == "other-rank")
    errors = WarningRecords()
    errors.setLevel(logging.ERROR)
    logging.getLogger(moriio_connector.__name__).addHandler(errors)
    try:
        worker.start_load_kv(_metadata({"x": FAILING_PORT, "y": HEALTHY_PORT}))
        results = worker.get_transfer_results()
        assert results.failed_recving == {"x"}
        assert "x" in results.finished_recving
        assert "t-x" in worker.released
        if load == "asynchronous":
            assert results.finished_recving == {"x", "y"}
            assert sorted(worker.released) == ["t-x", "t-y"]
        assert worker.posted, "the healthy prefiller's READ was not posted"
        lines = [record.getMessage() for record in errors.records]
        assert len(lines) == 1 and "\n" not in lines[0]
        assert f"127.0.0.1:{FAILING_PORT}" in lines[0]
        if failing == "this-rank":
            assert lines[0].endswith(f": {REASON}")
        # Reported once: no later step reports it again.
        worker.moriio_config.recv_abort_timeout = -1.0
        worker.start_load_kv(moriio_connector.MoRIIOConnectorMetadata())
        assert worker.get_transfer_results().failed_recving == set()
        # A later request from that prefiller handshakes again.
        worker.handshakes.clear()
        worker.start_load_kv(_metadata({"z": FAILING_PORT}))
        assert worker.handshakes == [FAILING_PORT]
        assert worker.get_transfer_results().failed_recving == {"z"}
    finally:
        logging.getLogger(moriio_connector.__name__).removeHandler(errors)
        worker.shutdown()
