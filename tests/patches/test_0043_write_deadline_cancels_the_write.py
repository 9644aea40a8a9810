"""Patch 0043: a WRITE decoder cancels a write it did not receive in time,
and reuses the pages only once nothing more can land in them.

A prefiller that goes silent after a layer (it died, its writer stalled)
left the decoder's request waiting for ``write_done`` forever. The
decoder's scheduler now cancels the write with each prefill rank past
``write_recv_timeout`` (a ``release`` carrying ``write_cancel``); a
prefiller of this build posts no more of it and, once the layers it posted
completed, sends ``write_failed``, so the decoder recomputes the request.
Without that acknowledgement (a prefiller that is gone, or of another
build: it takes the message as a plain release) the pages stay the
request's until ``write_quarantine_timeout``, then the workers end the
receive as failed and ignore any later report.

The scheduler side is the real ``MoRIIOConnector`` of a WRITE decoder; the
write side is two real WRITE workers over stubbed mori
whose WRITEs copy bytes between the legs' tensors.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common,
    moriio_connector,
    moriio_engine,
)
from vllm.v1.outputs import KVConnectorOutput

from tests.patches.builders import (
    LAYER,
    _role,
    full_attention_spec,
    make_kv_cache_blocks,
    make_kv_cache_config,
    make_request,
    make_scheduler_connector,
    make_scheduler_output,
    make_vllm_config,
    moriio_kv_transfer_config,
    write_params,
)
from tests.patches.test_0033_write_failure_tells_the_decoder import (
    B,
    LAYERS,
    LoopbackWrapper,
    _connect,
    _decoder_allocates,
    _Event,
    _leg,
    _notices,
    _save_meta,
    _Socket,
)

DEADLINE_S = 0.2
QUARANTINE_S = 0.4


@pytest.fixture
def loopback(
    copying_mori: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[bytes]]:
    """Workers built in the test get a ``LoopbackWrapper``; every
    notification any of them sends lands in the yielded outbox."""
    outbox: list[bytes] = []

    def wrapper(**kwargs: Any) -> LoopbackWrapper:
        built = LoopbackWrapper(**kwargs)
        built.outbox = outbox
        return built

    monkeypatch.setattr(moriio_connector, "MoRIIOWrapper", wrapper)
    monkeypatch.setattr(moriio_engine, "make_zmq_socket", lambda **kw: _Socket(outbox))
    # The write task's event: the forward has run (CPU).
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    yield outbox


class _Sent:
    def __init__(self, sent: list[tuple[str, dict[str, Any]]], path: str) -> None:
        self.sent, self.path = sent, path

    def send(self, data: bytes) -> None:
        self.sent.append((self.path, msgpack.loads(data)))


def _decoder(model_dir: Path, monkeypatch: pytest.MonkeyPatch, sent: list) -> Any:
    monkeypatch.setattr(
        moriio_connector,
        "make_zmq_socket",
        lambda ctx, path, **kw: _Sent(sent, path),
    )
    vllm_config = make_vllm_config(
        model_dir,
        moriio_kv_transfer_config(
            "kv_consumer",
            read_mode=False,
            write_recv_timeout=DEADLINE_S,
            write_quarantine_timeout=QUARANTINE_S,
        ),
        block_size=B,
    )
    return make_scheduler_connector(
        vllm_config, make_kv_cache_config([([LAYER], full_attention_spec(B))])
    )


def _admit(connector: Any, request_id: str, n: int = 40) -> Any:
    """The decoder allocates ``request_id`` and sends the prefiller its pages."""
    request = make_request(
        request_id, n, write_params(f"t-{request_id}", do_remote_prefill=True)
    )
    num_external, is_async = connector.get_num_new_matched_tokens(request, 0)
    assert num_external > 0 and is_async
    blocks = list(range(1, (n + B - 1) // B + 1))
    connector.update_state_after_alloc(
        request, make_kv_cache_blocks([blocks]), num_external
    )
    return request


def _cancels(sent: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
    return [
        (path, message["transfer_id"])
        for path, message in sent
        if message.get("type") == "release" and message.get("write_cancel")
    ]


def test_overdue_write_is_cancelled_then_its_pages_quarantined(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``write_recv_timeout`` the decoder sends the cancel to the
    prefill rank it sent its pages to, once, and ends nothing: the pages
    stay the request's. Past ``write_quarantine_timeout`` with no report,
    the workers are told to end the receive (failed). A request received in
    time is never cancelled."""
    sent: list[tuple[str, dict[str, Any]]] = []
    connector = _decoder(llama_model_dir, monkeypatch, sent)
    _admit(connector, "x")
    _admit(connector, "c")
    (allocated,) = {path for path, m in sent if m.get("type") == "remote_blocks"}

    meta = connector.build_connector_meta(make_scheduler_output())
    assert meta.expired_write_transfers == []
    assert _cancels(sent) == []
    connector.update_connector_output(KVConnectorOutput(finished_recving={"c"}))

    time.sleep(DEADLINE_S)
    meta = connector.build_connector_meta(make_scheduler_output())
    assert _cancels(sent) == [(allocated, "t-x")]
    assert meta.expired_write_transfers == []
    meta = connector.build_connector_meta(make_scheduler_output())
    assert _cancels(sent) == [(allocated, "t-x")]
    assert meta.expired_write_transfers == []

    time.sleep(QUARANTINE_S)
    meta = connector.build_connector_meta(make_scheduler_output())
    assert meta.expired_write_transfers == ["t-x"]
    meta = connector.build_connector_meta(make_scheduler_output())
    assert meta.expired_write_transfers == []


def test_acknowledged_cancel_ends_the_quarantine(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled write the workers report (the prefiller's write_failed)
    is not ended again when the quarantine would have run out."""
    sent: list[tuple[str, dict[str, Any]]] = []
    connector = _decoder(llama_model_dir, monkeypatch, sent)
    _admit(connector, "x")
    time.sleep(DEADLINE_S)
    connector.build_connector_meta(make_scheduler_output())
    assert _cancels(sent)
    connector.update_connector_output(
        KVConnectorOutput(finished_recving={"x"}, failed_recving={"x"})
    )
    time.sleep(QUARANTINE_S)
    meta = connector.build_connector_meta(make_scheduler_output())
    assert meta.expired_write_transfers == []


def _cancel(prefill: Any, transfer_id: str) -> None:
    """The decoder's cancel of ``transfer_id`` reaches the prefiller."""
    message = {
        "type": "release",
        "transfer_id": transfer_id,
        "consumer_tp_size": 1,
        "write_cancel": 1,
    }
    with _role(moriio_common, moriio_common.ROLE.PRODUCER):
        prefill.worker.moriio_wrapper._handle_message(msgpack.dumps(message))


def test_cancelled_write_posts_no_more_and_is_reported_failed(
    loopback: list[bytes],
    llama_model_dir: Path,
) -> None:
    """The cancel reaches the prefiller after it wrote the first layer: it
    writes no later layer into the decoder's pages, sends write_failed (no
    write_done) and releases its blocks; the decoder's worker reports the
    request failed, so its scheduler recomputes it."""
    prefill = _leg(llama_model_dir, "kv_producer")
    decode = _leg(llama_model_dir, "kv_consumer")
    _connect(prefill, decode)
    prefill_blocks, decode_blocks = [1, 2], [5, 6]
    before = decode.kv_caches[LAYERS[1]][decode_blocks].view(torch.uint8).clone()
    _decoder_allocates(prefill, "t-x", decode_blocks)
    save = types.SimpleNamespace(reqs_to_save={"x": _save_meta("t-x", prefill_blocks)})
    worker = prefill.worker
    worker.save_kv_layer(save, LAYERS[0], worker.kv_caches[LAYERS[0]], None)
    want = prefill.kv_caches[LAYERS[0]][prefill_blocks].view(torch.uint8)
    deadline = time.monotonic() + 3.0
    while not torch.equal(
        decode.kv_caches[LAYERS[0]][decode_blocks].view(torch.uint8), want
    ):
        assert time.monotonic() < deadline, "the first layer was never written"
        time.sleep(0.01)

    _cancel(prefill, "t-x")
    worker.save_kv_layer(save, LAYERS[1], worker.kv_caches[LAYERS[1]], None)
    worker._writer.seal_pending_transfers()

    notices = _notices(loopback, {"t-x"})
    assert [n["type"] for n in notices.get("t-x", [])] == ["write_failed"]
    got = decode.kv_caches[LAYERS[1]][decode_blocks].view(torch.uint8)
    assert torch.equal(got, before)
    with worker.moriio_wrapper.lock:
        released = [ack.transfer_id for ack in worker.moriio_wrapper.done_req_ids]
    assert released == ["t-x"]

    decoder = decode.worker
    decoder.start_load_kv(
        types.SimpleNamespace(
            transfer_id_to_request_id={"t-x": "x"}, expired_write_transfers=[]
        )
    )
    with _role(moriio_common, moriio_common.ROLE.CONSUMER):
        for payload in loopback:
            decoder.moriio_wrapper._handle_message(payload)
    results = decoder.get_transfer_results()
    assert results.failed_recving == {"x"}


def test_unacknowledged_write_ends_failed_and_ignores_late_reports(
    loopback: list[bytes],
    llama_model_dir: Path,
) -> None:
    """The scheduler ends a quarantined transfer: the decoder's worker
    reports it failed once, and a write_done arriving later (a producer
    that was only slow) is never reported for the recomputed request."""
    decoder = _leg(llama_model_dir, "kv_consumer").worker
    mapping = {"t-x": "x"}
    decoder.start_load_kv(
        types.SimpleNamespace(
            transfer_id_to_request_id=mapping, expired_write_transfers=["t-x"]
        )
    )
    results = decoder.get_transfer_results()
    assert (results.failed_recving, results.finished_recving) == ({"x"}, {"x"})

    with _role(moriio_common, moriio_common.ROLE.CONSUMER):
        decoder.moriio_wrapper._handle_message(
            msgpack.dumps(
                {"type": "write_done", "transfer_id": "t-x", "moriio_protocol": 1}
            )
        )
    decoder.start_load_kv(
        types.SimpleNamespace(
            transfer_id_to_request_id=mapping, expired_write_transfers=[]
        )
    )
    results = decoder.get_transfer_results()
    assert (results.failed_recving, results.finished_recving) == (set(), set())


def test_release_without_cancel_releases_at_once(
    loopback: list[bytes],
    llama_model_dir: Path,
) -> None:
    """A release without ``write_cancel`` (a decoder with a full local hit,
    or of another build) still releases the prefiller's blocks at once and
    is answered by nothing."""
    prefill = _leg(llama_model_dir, "kv_producer")
    _decoder_allocates(prefill, "t-x", [5, 6])
    with _role(moriio_common, moriio_common.ROLE.PRODUCER):
        prefill.worker.moriio_wrapper._handle_message(
            msgpack.dumps(
                {"type": "release", "transfer_id": "t-x", "consumer_tp_size": 1}
            )
        )
    wrapper = prefill.worker.moriio_wrapper
    with wrapper.lock:
        assert [ack.transfer_id for ack in wrapper.done_req_ids] == ["t-x"]
        assert "t-x" not in wrapper.done_remote_allocate_req_dict
    assert loopback == []
