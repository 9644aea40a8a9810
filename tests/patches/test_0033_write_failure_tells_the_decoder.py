"""Patch 0033: a WRITE that fails on the prefiller tells the decoder.

A layer whose write the prefiller cannot plan (or any other error while it
executes a write task) used to release the prefiller's blocks and tell the
decoder nothing: the decoder waited for the request until vLLM's own
timeout. The prefiller now sends ``write_failed`` for that transfer, after
the layers it already posted have landed, and the decoder's worker reports
the request in ``failed_recving``, so its scheduler serves it without the
transfer.

Both legs are real WRITE-mode ``MoRIIOConnectorWorker``s registering the
KV cache tensors vLLM's ``allocate_kv_cache`` lays out, over stubbed mori
whose WRITEs copy bytes between the two legs' tensors and whose
notifications are carried from one leg to the other by the test. The
prefiller's writes run on its real write worker thread.
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
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    MoRIIOError,
)

from tests.patches.builders import (
    DoneStatus,
    Region,
    RegisteredWorker,
    _role,
    fill_random,
    full_attention_spec,
    make_vllm_config,
    moriio_kv_transfer_config,
    paired_sessions,
    register_worker,
    remote_worker_meta,
)

B = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PEER = "127.0.0.1:7000"
WAIT_S = 3.0
"""How long the test waits for the prefiller's notifications."""


class LoopbackWrapper(moriio_engine.MoRIIOWrapper):
    """vLLM's MoRIIOWrapper with mori stubbed: a WRITE on a session (local
    region, remote region) copies the bytes at once; notifications go to
    ``outbox`` through its real message encoding."""

    def __init__(self, **_: Any) -> None:
        super().__init__()
        self.outbox: list[bytes] = []

    def set_moriio_engine(self, engine: Any) -> None:
        pass

    def set_backend_type(self, *_: Any, **__: Any) -> None:
        pass

    def register_local_tensor(self, tensor: torch.Tensor) -> Region:
        return Region(tensor)

    def get_agent_metadata(self) -> bytes:
        return b""

    def async_wait_reqid(self) -> None:
        pass

    def write_remote_data(self, sizes, local_offsets, remote_offsets, session):
        local, remote = session
        src, dst = local.tensor.view(torch.uint8), remote.tensor.view(torch.uint8)
        for lo, ro, size in zip(local_offsets, remote_offsets, sizes, strict=True):
            dst[ro : ro + size] = src[lo : lo + size]
        return DoneStatus()


class _Socket:
    def __init__(self, outbox: list[bytes]) -> None:
        self.outbox = outbox

    def send(self, payload: bytes) -> None:
        self.outbox.append(payload)


class _Event:
    def record(self, *_: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


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


def _leg(model_dir: Path, role: str) -> RegisteredWorker:
    vllm_config = make_vllm_config(
        model_dir,
        moriio_kv_transfer_config(role, read_mode=False),
        block_size=B,
    )
    leg = register_worker(
        vllm_config,
        {layer: full_attention_spec(B) for layer in LAYERS},
        "LBNHC",
        f"127.0.0.1:{role}",
    )
    fill_random(
        leg.buffer, torch.Generator().manual_seed(1 if role == "kv_producer" else 2)
    )
    return leg


def _connect(prefill: RegisteredWorker, decode: RegisteredWorker) -> None:
    """The prefiller's handshake with the decoder is done: its sessions pair
    each of its regions with the decoder's of the same layer."""
    worker = prefill.worker
    meta = remote_worker_meta(decode.worker)
    meta.attention_block_sizes = decode.worker.attention_block_sizes
    meta.layer_offsets = decode.worker.kv_layer_mr_offset
    sessions = paired_sessions(worker, decode.worker)
    worker._get_built_session = lambda engine_id: (sessions, meta)
    worker._remote_layer_mr_offset = lambda layer, m, _: m.layer_offsets[layer]
    worker._remote_agents[worker.get_engine_name_with_dp(PEER, 0)] = object()
    worker.write_ready_flags[PEER] = True


def _save_meta(transfer_id: str, prefill_blocks: list[int]) -> Any:
    """The prefiller's ``ReqMeta`` of a request to write (decoder on this
    host, TP 1, one DP rank)."""
    host, port = PEER.split(":")
    return types.SimpleNamespace(
        transfer_id=transfer_id,
        local_block_ids=[prefill_blocks],
        remote_block_ids=None,
        remote_host=host,
        remote_handshake_port=int(port),
        remote_notify_port=9000,
        tp_size=1,
        remote_dp_size=1,
        remote_dp_size_local=0,
        multi_pod_hosts=[],
        write_start_blocks=None,
    )


def _decoder_allocates(prefill: RegisteredWorker, transfer_id: str, blocks) -> None:
    """The decoder's ``remote_blocks`` message for ``transfer_id`` (it holds
    none of the pages) reaches the prefiller."""
    message = {
        "req_id": transfer_id,
        "transfer_id": transfer_id,
        "block_notify_list": [blocks],
        "decode_rank": 0,
        "type": "remote_blocks",
        "num_held_blocks": [0],
    }
    with _role(moriio_common, moriio_common.ROLE.PRODUCER):
        prefill.worker.moriio_wrapper._handle_message(msgpack.dumps(message))


def _notices(outbox: list[bytes], transfers: set[str]) -> dict[str, list[Any]]:
    """Each notification of ``transfers`` the prefiller sent, waiting a few
    seconds for one per transfer."""
    deadline = time.monotonic() + WAIT_S
    while True:
        got: dict[str, list[Any]] = {}
        for payload in list(outbox):
            data = msgpack.loads(payload)
            got.setdefault(data["transfer_id"], []).append(data)
        if set(got) >= transfers or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def _fail_layer(monkeypatch: pytest.MonkeyPatch, transfer_id: str, layer: str):
    """The writer's layer planner raises for ``layer`` of ``transfer_id``."""
    plan = moriio_engine.MoRIIOWriter._prepare_transfer_plan

    def prepare(self, task, *args: Any, **kwargs: Any):
        if (task.transfer_id, task.layer_name) == (transfer_id, layer):
            raise MoRIIOError(f"cannot plan {layer}")
        return plan(self, task, *args, **kwargs)

    monkeypatch.setattr(moriio_engine.MoRIIOWriter, "_prepare_transfer_plan", prepare)


@pytest.mark.parametrize("failing_layer", [0, 1], ids=["first-layer", "after-a-layer"])
def test_failed_write_is_reported_to_the_decoder(
    loopback: list[bytes],
    monkeypatch: pytest.MonkeyPatch,
    llama_model_dir: Path,
    failing_layer: int,
) -> None:
    """Two requests are written in one step; the writer cannot plan a layer
    of one of them (its first, or one after a layer was written). The
    decoder's worker reports that request in ``failed_recving``, never as
    loaded, and the other request's pages hold the prefiller's bytes. The
    prefiller releases both requests' blocks."""
    prefill = _leg(llama_model_dir, "kv_producer")
    decode = _leg(llama_model_dir, "kv_consumer")
    _connect(prefill, decode)
    before = {
        layer: decode.kv_caches[layer][[5, 6]].view(torch.uint8).clone()
        for layer in LAYERS
    }
    _fail_layer(monkeypatch, "t-bad", LAYERS[failing_layer])
    requests = {
        "ok": ([1, 2], [5, 6]),
        "bad": ([3, 4], [7, 8]),
    }
    for name, (_, decode_blocks) in requests.items():
        _decoder_allocates(prefill, f"t-{name}", decode_blocks)
    save = types.SimpleNamespace(
        reqs_to_save={
            name: _save_meta(f"t-{name}", prefill_blocks)
            for name, (prefill_blocks, _) in requests.items()
        }
    )
    prefill.worker.wait_for_save(save)

    notices = _notices(loopback, {"t-ok", "t-bad"})
    assert [n["type"] for n in notices.get("t-ok", [])] == ["write_done"]
    assert [n["type"] for n in notices.get("t-bad", [])] == ["write_failed"]
    with prefill.worker.moriio_wrapper.lock:
        released = {
            ack.transfer_id for ack in prefill.worker.moriio_wrapper.done_req_ids
        }
    assert released == {"t-ok", "t-bad"}

    # The decoder's worker receives what the prefiller sent.
    decoder = decode.worker
    decoder.start_load_kv(
        types.SimpleNamespace(
            transfer_id_to_request_id={"t-ok": "ok", "t-bad": "bad"},
            expired_write_transfers=[],
        )
    )
    with _role(moriio_common, moriio_common.ROLE.CONSUMER):
        for payload in loopback:
            decoder.moriio_wrapper._handle_message(payload)
    results = decoder.get_transfer_results()
    assert results.failed_recving == {"bad"}
    assert results.finished_recving == {"ok", "bad"}

    if failing_layer:
        # The layer before the failing one was written, and not trusted.
        prefill_blocks, decode_blocks = requests["bad"]
        got = decode.kv_caches[LAYERS[0]][decode_blocks].view(torch.uint8)
        want = prefill.kv_caches[LAYERS[0]][prefill_blocks].view(torch.uint8)
        assert torch.equal(got, want)
    prefill_blocks, decode_blocks = requests["ok"]
    for layer in LAYERS:
        got = decode.kv_caches[layer][decode_blocks].view(torch.uint8)
        want = prefill.kv_caches[layer][prefill_blocks].view(torch.uint8)
        assert not torch.equal(before[layer], want), layer
        assert torch.equal(got, want), layer


def test_decoder_waits_for_every_writer_of_a_failed_transfer(
    loopback: list[bytes], llama_model_dir: Path
) -> None:
    """With two prefill ranks writing one decode rank, one rank's
    ``write_failed`` ends the transfer only once the other rank reported
    too (it may still be writing into the decoder's pages); it ends failed
    whichever rank failed."""
    decode = _leg(llama_model_dir, "kv_consumer")
    wrapper = decode.worker.moriio_wrapper
    with _role(moriio_common, moriio_common.ROLE.CONSUMER):
        for first, second in (
            ("write_failed", "write_done"),
            ("write_done", "write_failed"),
        ):
            transfer_id = f"t-{first}"
            for message_type in (first, second):
                assert wrapper.pop_failed_write_req_ids() == set()
                wrapper._handle_message(
                    msgpack.dumps(
                        {
                            "type": message_type,
                            "transfer_id": transfer_id,
                            "num_writers": 2,
                        }
                    )
                )
            assert wrapper.pop_failed_write_req_ids() == {transfer_id}
            assert wrapper.pop_finished_write_req_ids() == set()
