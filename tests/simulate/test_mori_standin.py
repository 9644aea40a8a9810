"""The loopback ``mori`` stand-in keeps mori's documented semantics.

Loaded from its file, not as ``mori``: nothing in the test process may
import it under that name (the MoRIIO connector would then believe mori is
installed). The target engine runs in a forked process, so every transfer
crosses processes over the control plane and shared memory as in the
simulator.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

STANDIN = (
    Path(__file__).resolve().parents[2]
    / "vllm_overlay/simulate/bytes/standin/mori/io/_loopback.py"
)
SIZE = 1 << 16


def _load():
    spec = importlib.util.spec_from_file_location("loopback_standin", STANDIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


io = _load()


def _shared(path: str, fill: int) -> np.memmap:
    arr = np.memmap(path, dtype=np.uint8, mode="w+", shape=(SIZE,))
    arr[:] = fill
    return arr


def _target(conn, path: str) -> None:
    mem = _shared(path, 0)
    mem[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
    engine = io.IOEngine("target", io.IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
    desc = engine.register_memory(mem.ctypes.data, SIZE, -1, io.MemoryLocationType.CPU)
    conn.send((engine.get_engine_desc().pack(), desc.pack()))
    conn.recv()  # the test is done with this engine's memory
    conn.send(bytes(mem[:64]))
    os._exit(0)


@pytest.fixture
def pair(tmp_path):
    path = f"/dev/shm/standin-test-{uuid.uuid4().hex}"
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, path), daemon=True)
    proc.start()
    assert parent.poll(60), "the target engine did not start"
    engine_desc, mem_desc = parent.recv()
    local = _shared(str(tmp_path / "local"), 0)
    engine = io.IOEngine("initiator", io.IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
    remote_engine = io.EngineDesc.unpack(engine_desc)
    remote_mem = io.MemoryDesc.unpack(mem_desc)
    local_mem = engine.register_memory(
        local.ctypes.data, SIZE, -1, io.MemoryLocationType.CPU
    )
    yield engine, remote_engine, local_mem, remote_mem, local, parent
    parent.send("done")
    proc.join(10)
    os.unlink(path)


def test_descriptors_round_trip_through_pack():
    desc = io.MemoryDesc("e", 3, -1, "", 4096, 128, io.MemoryLocationType.CPU)
    assert io.MemoryDesc.unpack(desc.pack()) == desc
    engine = io.EngineDesc("k", "n", "h", "127.0.0.1", 5, 6)
    assert io.EngineDesc.unpack(engine.pack()) == engine


def test_no_session_before_the_remote_engine_is_registered(pair):
    engine, _, local_mem, remote_mem, *_ = pair
    assert engine.create_session(local_mem, remote_mem) is None


def test_batch_read_copies_at_offsets_relative_to_each_region(pair):
    engine, remote_engine, local_mem, remote_mem, local, _ = pair
    engine.register_remote_engine(remote_engine)
    session = engine.create_session(local_mem, remote_mem)
    status = session.batch_read([0, 100], [10, 1000], [4, 8], 1)
    assert engine.wait_all([status], timeout_ms=5000) == io.StatusCode.SUCCESS
    assert status.Succeeded() and not status.Failed()
    assert local[:4].tolist() == [10, 11, 12, 13]
    assert local[100:108].tolist() == [(1000 + i) % 256 for i in range(8)]
    assert local[4:100].tolist() == [0] * 96
    assert engine.loopback_stats.bytes_read == 12


def test_batch_write_lands_in_the_remote_region(pair):
    engine, remote_engine, local_mem, remote_mem, local, conn = pair
    engine.register_remote_engine(remote_engine)
    local[:8] = 7
    session = engine.create_session(local_mem, remote_mem)
    status = session.batch_write([0], [32], [8], 2)
    assert engine.wait_all([status], timeout_ms=5000) == io.StatusCode.SUCCESS
    conn.send("done")
    head = conn.recv()
    conn.send = lambda *_: None  # the fixture's own "done" is already sent
    assert list(head[32:40]) == [7] * 8
    assert list(head[:32]) == list(range(32))


def test_out_of_range_fails_the_whole_batch_before_anything_moves(pair):
    engine, remote_engine, local_mem, remote_mem, local, _ = pair
    engine.register_remote_engine(remote_engine)
    session = engine.create_session(local_mem, remote_mem)
    status = session.batch_read([0, 0], [0, SIZE - 2], [4, 4], 3)
    assert status.Failed()
    assert status.Code() == io.StatusCode.ERR_INVALID_ARGS
    assert status.Message() == "length out of range"
    assert engine.wait_all([status], timeout_ms=0) == io.StatusCode.ERR_INVALID_ARGS
    assert local[:4].tolist() == [0] * 4
    assert engine.loopback_stats.bytes_read == 0


def test_unequal_lists_empty_batches_and_negative_offsets(pair):
    engine, remote_engine, local_mem, remote_mem, _, _ = pair
    engine.register_remote_engine(remote_engine)
    session = engine.create_session(local_mem, remote_mem)
    mismatch = session.batch_read([0], [0, 1], [4], 4)
    assert mismatch.Code() == io.StatusCode.ERR_INVALID_ARGS
    empty = session.batch_read([], [], [], 5)
    assert empty.Succeeded()
    with pytest.raises(TypeError):
        session.batch_read([-1], [0], [4], 6)


def test_a_remote_size_mismatch_refuses_the_session(pair):
    engine, remote_engine, local_mem, remote_mem, _, _ = pair
    engine.register_remote_engine(remote_engine)
    wrong = io.MemoryDesc.unpack(remote_mem.pack())
    wrong.size += 1
    with pytest.raises(RuntimeError, match="remote MR size mismatch"):
        engine.create_session(local_mem, wrong)


def test_wait_all_lets_a_failure_win_over_success():
    ok, failed = io.TransferStatus(), io.TransferStatus()
    ok.Update(io.StatusCode.SUCCESS, "")
    failed.Update(io.StatusCode.ERR_RDMA_OP, "boom")
    failed.Update(io.StatusCode.SUCCESS, "")  # a failure is final
    engine = io.IOEngine("solo", io.IOEngineConfig("127.0.0.1", 0))
    assert engine.wait_all([]) == io.StatusCode.SUCCESS
    assert engine.wait_all([ok, failed], timeout_ms=100) == io.StatusCode.ERR_RDMA_OP
    pending = io.TransferStatus()
    pending.SetCode(io.StatusCode.IN_PROGRESS)
    assert engine.wait_all([ok, pending], timeout_ms=0) == io.StatusCode.IN_PROGRESS
    assert engine.wait_all([pending], timeout_ms=20) == io.StatusCode.IN_PROGRESS


def test_only_loopback_control_planes():
    engine = io.IOEngine("far", io.IOEngineConfig("10.0.0.1", 0))
    with pytest.raises(RuntimeError, match="loopback"):
        engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())


def test_a_control_plane_port_in_use_is_named():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine = io.IOEngine("late", io.IOEngineConfig("127.0.0.1", port))
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
            engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())


def test_private_memory_cannot_be_reached_by_a_peer():
    buf = np.zeros(4096, dtype=np.uint8)
    engine = io.IOEngine("private", io.IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
    desc = engine.register_memory(buf.ctypes.data, 4096, -1, io.MemoryLocationType.CPU)
    assert engine._answer({"op": "ask_mr", "id": desc.id}) == {"ok": False, "length": 0}


def test_the_standin_never_enters_the_image_or_a_wheel():
    root = Path(__file__).resolve().parents[2]
    standin = STANDIN.parents[2].relative_to(root).as_posix()
    ignored = (root / ".dockerignore").read_text().splitlines()
    assert standin in ignored
    from setuptools import find_packages

    packages = find_packages(root, include=["vllm_overlay*"])
    assert "vllm_overlay.simulate.bytes" in packages
    assert not [p for p in packages if "standin" in p or "mori" in p]
