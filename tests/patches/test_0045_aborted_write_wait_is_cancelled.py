"""Patch 0045: a request aborted while its WRITE is awaited gives its pages
back once nothing more can land in them.

vLLM's scheduler holds the blocks of a request aborted in
``WAITING_FOR_REMOTE_KVS`` until the connector reports it in
``finished_recving`` (``_aborted_kv_loads``). The WRITE decoder's
``request_finished`` dropped the request's transfer id at once, so the
prefiller's final report (write_done, write_failed) was never matched to the
request and its blocks were never freed. The decoder now cancels the write
with the prefiller at once (the overdue write's cancel and quarantine) and
keeps the transfer mapped until it is reported.

The scheduler is vLLM's real ``Scheduler`` with the MoRIIO connector of a
WRITE decoder; the write side is two real WRITE workers over stubbed mori
whose WRITEs copy bytes between the legs' tensors (a loopback wrapper).
"""

from __future__ import annotations

import time
import types
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common,
    moriio_connector,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tests.patches.builders import (
    RegisteredWorker,
    _role,
    build_scheduler,
    full_attention_spec,
    make_request,
    model_runner_output,
    write_params,
)
from tests.patches.test_0033_write_failure_tells_the_decoder import (
    B,
    LAYERS,
    _connect,
    _leg,
    _notices,
    _save_meta,
)
from tests.patches.test_0043_write_deadline_cancels_the_write import (
    _cancels,
    _Sent,
    loopback,  # noqa: F401  (fixture)
)

NUM_BLOCKS = 32
QUARANTINE_S = 0.3


def _scheduler(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    sent: list,
    extra_config: dict[str, Any] | None = None,
) -> Scheduler:
    monkeypatch.setattr(
        moriio_connector,
        "make_zmq_socket",
        lambda ctx, path, **kw: _Sent(sent, path),
    )
    return build_scheduler(
        model_dir,
        "kv_consumer",
        [(list(LAYERS), full_attention_spec(B))],
        B,
        NUM_BLOCKS,
        read_mode=False,
        extra_config=extra_config,
    )


def _free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def _waiting(scheduler: Scheduler, request_id: str) -> tuple[Any, list[int]]:
    """``request_id`` is admitted: the decoder allocated its pages and sent
    them to the prefiller. Its scheduler output and its pages."""
    request = make_request(
        request_id, 40, write_params(f"t-{request_id}", do_remote_prefill=True)
    )
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (blocks,) = scheduler.kv_cache_manager.get_block_ids(request_id)
    return output, list(blocks)


def _deliver(worker: Any, role: Any, messages: list[dict[str, Any]]) -> None:
    with _role(moriio_common, role):
        for message in messages:
            worker.moriio_wrapper._handle_message(msgpack.dumps(message))


def _step(scheduler: Scheduler, decoder: Any, reports: list[bytes]) -> None:
    """One engine step: the decoder's worker takes the step's metadata and
    the prefiller's reports; the scheduler takes what the worker found."""
    output = scheduler.schedule()
    decoder.start_load_kv(output.kv_connector_metadata)
    _deliver(
        decoder,
        moriio_common.ROLE.CONSUMER,
        [msgpack.loads(payload) for payload in reports],
    )
    results = decoder.get_transfer_results()
    kv_connector_output = KVConnectorOutput(
        finished_recving=results.finished_recving or None,
        failed_recving=results.failed_recving,
    )
    scheduler.update_from_output(
        output, model_runner_output([], kv_connector_output=kv_connector_output)
    )


def _write_layer(prefill: RegisteredWorker, save: Any, layer: str) -> None:
    prefill.worker.save_kv_layer(save, layer, prefill.kv_caches[layer], None)


def test_aborted_write_wait_is_cancelled_and_its_blocks_freed_once_acknowledged(
    loopback: list[bytes],  # noqa: F811
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client aborts while the prefiller has written one layer: the
    decoder cancels the write with the prefill rank it sent its pages to, at
    once, and holds the pages. The prefiller writes no later layer and
    reports write_failed; only then are the pages freed, and the aborted
    request is not counted as a fallback."""
    sent: list[tuple[str, dict[str, Any]]] = []
    scheduler = _scheduler(llama_model_dir, monkeypatch, sent)
    free = _free_blocks(scheduler)
    _, decode_blocks = _waiting(scheduler, "x")
    ((path, allocation),) = [
        (p, m) for p, m in sent if m.get("type") == "remote_blocks"
    ]
    prefill = _leg(llama_model_dir, "kv_producer")
    decode = _leg(llama_model_dir, "kv_consumer")
    _connect(prefill, decode)
    _deliver(prefill.worker, moriio_common.ROLE.PRODUCER, [allocation])
    before = decode.kv_caches[LAYERS[1]][decode_blocks].view(torch.uint8).clone()
    save = types.SimpleNamespace(reqs_to_save={"x": _save_meta("t-x", [1, 2, 3])})
    _write_layer(prefill, save, LAYERS[0])

    scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    assert _free_blocks(scheduler) < free
    assert _cancels(sent) == [(path, "t-x")]
    _deliver(
        prefill.worker,
        moriio_common.ROLE.PRODUCER,
        [m for _, m in sent if m.get("write_cancel")],
    )
    _write_layer(prefill, save, LAYERS[1])
    prefill.worker._writer.seal_pending_transfers()
    notices = _notices(loopback, {"t-x"})
    assert [n["type"] for n in notices.get("t-x", [])] == ["write_failed"]

    _step(scheduler, decode.worker, loopback)
    assert _free_blocks(scheduler) == free
    assert "x" not in scheduler.requests
    got = decode.kv_caches[LAYERS[1]][decode_blocks].view(torch.uint8)
    assert torch.equal(got, before)
    connector = scheduler.connector.connector_scheduler
    assert connector.transfer_id_to_request_id == {}
    assert "its KV transfer failed" not in caplog.text
    # The cancel is sent once.
    assert len(_cancels(sent)) == 1


def test_write_landing_after_abort_frees_the_blocks(
    loopback: list[bytes],  # noqa: F811
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefiller that completes the write although the decoder aborted
    (the cancel came too late, or it is of another build) reports
    write_done: the aborted request's pages are freed then."""
    sent: list[tuple[str, dict[str, Any]]] = []
    scheduler = _scheduler(llama_model_dir, monkeypatch, sent)
    free = _free_blocks(scheduler)
    _waiting(scheduler, "x")
    (allocation,) = [m for _, m in sent if m.get("type") == "remote_blocks"]
    prefill = _leg(llama_model_dir, "kv_producer")
    decode = _leg(llama_model_dir, "kv_consumer")
    _connect(prefill, decode)
    _deliver(prefill.worker, moriio_common.ROLE.PRODUCER, [allocation])

    scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    save = types.SimpleNamespace(reqs_to_save={"x": _save_meta("t-x", [1, 2, 3])})
    prefill.worker.wait_for_save(save)
    notices = _notices(loopback, {"t-x"})
    assert [n["type"] for n in notices.get("t-x", [])] == ["write_done"]
    assert _free_blocks(scheduler) < free

    _step(scheduler, decode.worker, loopback)
    assert _free_blocks(scheduler) == free
    assert "x" not in scheduler.requests


def test_unacknowledged_aborted_write_frees_the_blocks_after_quarantine(
    loopback: list[bytes],  # noqa: F811
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No prefiller ever reports the aborted request's write (it is gone):
    its pages stay held through write_quarantine_timeout, then are freed."""
    sent: list[tuple[str, dict[str, Any]]] = []
    scheduler = _scheduler(
        llama_model_dir,
        monkeypatch,
        sent,
        {"write_quarantine_timeout": QUARANTINE_S},
    )
    free = _free_blocks(scheduler)
    _waiting(scheduler, "x")
    decoder = _leg(llama_model_dir, "kv_consumer").worker

    scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    _step(scheduler, decoder, [])
    assert _free_blocks(scheduler) < free
    time.sleep(QUARANTINE_S)
    _step(scheduler, decoder, [])
    assert _free_blocks(scheduler) == free
    assert "x" not in scheduler.requests


def test_received_request_ends_without_cancel(
    loopback: list[bytes],  # noqa: F811
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request aborted after its write was received sends no cancel: its
    pages are freed at once and its transfer is forgotten."""
    sent: list[tuple[str, dict[str, Any]]] = []
    scheduler = _scheduler(llama_model_dir, monkeypatch, sent)
    free = _free_blocks(scheduler)
    _waiting(scheduler, "x")
    decoder = _leg(llama_model_dir, "kv_consumer").worker
    done = {"type": "write_done", "transfer_id": "t-x", "moriio_protocol": 1}
    _step(scheduler, decoder, [msgpack.dumps(done)])

    scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    assert _free_blocks(scheduler) == free
    assert _cancels(sent) == []
    connector = scheduler.connector.connector_scheduler
    assert connector.transfer_id_to_request_id == {}
