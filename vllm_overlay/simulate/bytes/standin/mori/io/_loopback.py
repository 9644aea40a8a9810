"""The loopback stand-in engine: one-sided copies between registered CPU
memory of processes on this machine.

What it reproduces of mori's IO engine (ROCm/mori at 624002c8; paths are in
that repository):

- Names and call signatures of the Python API the MoRIIO connector uses
  (``python/mori/io/engine.py``: ``IOEngine``, ``IOEngineSession``;
  ``src/pybind/pybind_io.cpp``: the enums, ``IOEngineConfig``,
  ``RdmaBackendConfig``, ``XgmiBackendConfig``, ``EngineDesc`` and
  ``MemoryDesc`` with ``pack``/``unpack``, ``TransferStatus``).
- Memory registration (``IOEngine::RegisterMemory``, ``src/io/engine.cpp``):
  a descriptor with the engine key, a per-engine id, the address and size;
  ``register_torch_tensor`` rejects non-contiguous tensors
  (``engine.py``).
- Sessions (``IOEngine::CreateSession``, ``RdmaBackend::CreateSession`` in
  ``src/io/rdma/backend_impl.cpp``): ``None`` when no backend can reach the
  remote engine (no backend, or the remote engine is not registered); the
  remote memory region is fetched from the remote engine's control plane over
  TCP (``ControlPlaneServer::AskRemoteMemoryRegion``) and a size that differs
  from the descriptor's raises ``RuntimeError``.
- Batched one-sided READ/WRITE (``RdmaBatchReadWrite`` in
  ``src/io/rdma/common.cpp``): offsets are relative to each side's
  registered region; unequal list lengths, a request over ``UINT32_MAX`` or
  any ``offset + size`` past either region fail the whole batch with
  ``ERR_INVALID_ARGS`` before anything moves; an empty batch succeeds at
  once. Negative offsets are a ``TypeError``, as pybind11's ``size_t``
  conversion makes them.
- Completion (``TransferStatus`` in ``include/mori/io/common.hpp``): a posted
  transfer is ``IN_PROGRESS`` when the call returns and completes later on
  the engine's completion thread (the CQ poller's role); ``Failed()`` is any
  code above ``ERR_BEGIN``; a failure is final. ``IOEngine::WaitAll``:
  empty input succeeds, ``timeout_ms == 0`` polls once, a negative timeout
  waits for all, a positive one until the deadline; the first failure wins
  but does not end the wait.

What differs, on purpose: memory is reached through the file that backs it
(a shared mapping, e.g. under ``/dev/shm``), found in ``/proc/self/maps``,
instead of an RDMA memory key; the control plane only binds loopback
addresses; no GPUs, no NICs, no inbound notifications
(``pop_inbound_transfer_status`` finds nothing, as with the connector's
``enable_notification=False``); the engine-level ``read``/``write``/
``batch_read``/``batch_write`` taking memory descriptors are left out (the
connector posts through sessions only). Every engine counts the bytes it moved
(``loopback_stats``), which the simulator reports.

Transport faults (the simulator's ``simulate-bytes --faults``,
``set_transport_fault``) apply to the posts made for the requests a fault
names (``posting_for`` marks the thread posting for a request): ``error``,
every post completes failed and moves nothing; ``hang``, no post ever
completes or moves a byte; ``partial``, the first post moves the first half of
its runs (of its bytes, with one run) and fails, the next succeeds, and so on;
``drop``, the first post completes and no later one ever does (its process
left); ``late``, the second post is made ``LATE_POST_S`` late (the posting
thread stalls, then the post lands as any other). ``lie`` (a self-test of
the simulator's judge): every post moves the first half of its runs and
reports success.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import itertools
import mmap
import os
import queue
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

UINT32_MAX = (1 << 32) - 1
Ints = Sequence[int]
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


FAULT_KINDS = ("error", "hang", "partial", "drop", "late", "lie")
LATE_POST_S = 5.0
"""How late ``late`` makes its post: past the simulator's WRITE deadline
(``write_recv_timeout``, 4 s), so a decoder that reuses the pages at its
deadline gets them written over."""


@dataclass(frozen=True)
class TransportFault:
    """A fault for every post made for a request whose id starts with
    ``prefix`` (``FAULT_KINDS``)."""

    kind: str
    prefix: str


_FAULT: TransportFault | None = None
_POSTING = threading.local()


def set_transport_fault(fault: TransportFault | None) -> None:
    """Fault this process's posts from now on (None: none)."""
    global _FAULT
    if fault is not None and fault.kind not in FAULT_KINDS:
        raise ValueError(f"unknown transport fault {fault.kind!r}")
    _FAULT = fault


@contextlib.contextmanager
def posting_for(request_id: str) -> Any:
    """Posts on this thread are made for ``request_id`` until the block
    ends."""
    before = getattr(_POSTING, "request_id", None)
    _POSTING.request_id = str(request_id)
    try:
        yield
    finally:
        _POSTING.request_id = before


def faulted(request_id: str | None) -> TransportFault | None:
    """The fault for posts made for ``request_id``, if any."""
    fault = _FAULT
    if fault is None or request_id is None:
        return None
    return fault if str(request_id).startswith(fault.prefix) else None


class BackendType(enum.IntEnum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class MemoryLocationType(enum.IntEnum):
    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(enum.IntEnum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_BEGIN = 10
    ERR_INVALID_ARGS = 11
    ERR_NOT_FOUND = 12
    ERR_RDMA_OP = 13
    ERR_BAD_STATE = 14
    ERR_GPU_OP = 15


class PollCqMode(enum.IntEnum):
    POLLING = 0
    EVENT = 1


@dataclass
class IOEngineConfig:
    host: str = ""
    port: int = 0


@dataclass
class RdmaBackendConfig:
    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_worker_threads: int = -1
    poll_cq_mode: PollCqMode = PollCqMode.POLLING
    enable_notification: bool = True
    notif_per_qp: int = 1024
    enable_transfer_chunking: bool = False
    chunk_bytes: int = 65536
    max_chunks_per_transfer: int = 64
    num_nics_per_transfer: int = 1


@dataclass
class XgmiBackendConfig:
    num_streams: int = 64
    num_events: int = 64


@dataclass
class EngineDesc:
    key: str
    node_id: str = ""
    hostname: str = ""
    host: str = ""
    port: int = 0
    pid: int = 0

    def pack(self) -> bytes:
        return _packb(
            [self.key, self.node_id, self.hostname, self.host, self.port, self.pid]
        )

    @staticmethod
    def unpack(data: bytes) -> EngineDesc:
        return EngineDesc(*msgpack.unpackb(data))


@dataclass
class MemoryDesc:
    engine_key: str = ""
    id: int = 0
    device_id: int = -1
    device_bus_id: str = ""
    data: int = 0
    size: int = 0
    loc: MemoryLocationType = MemoryLocationType.Unknown
    numa_node: int = -1

    def pack(self) -> bytes:
        return _packb(
            [
                self.engine_key,
                self.id,
                self.device_id,
                self.device_bus_id,
                self.data,
                self.size,
                int(self.loc),
                self.numa_node,
            ]
        )

    @staticmethod
    def unpack(data: bytes) -> MemoryDesc:
        key, mem_id, dev, bus, addr, size, loc, numa = msgpack.unpackb(data)
        return MemoryDesc(
            key, mem_id, dev, bus, addr, size, MemoryLocationType(loc), numa
        )


class TransferStatus:
    """One transfer's state; the first failure is final (``Update``)."""

    def __init__(self) -> None:
        self._code = StatusCode.INIT
        self._msg = ""
        self._cv = threading.Condition()

    def Code(self) -> StatusCode:  # noqa: N802 (mori's method names)
        return self._code

    def CodeUint32(self) -> int:  # noqa: N802
        return int(self._code)

    def Message(self) -> str:  # noqa: N802
        with self._cv:
            return self._msg

    def Init(self) -> bool:  # noqa: N802
        return self._code == StatusCode.INIT

    def InProgress(self) -> bool:  # noqa: N802
        return self._code == StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:  # noqa: N802
        return self._code == StatusCode.SUCCESS

    def Failed(self) -> bool:  # noqa: N802
        return self._code > StatusCode.ERR_BEGIN

    def SetCode(self, code: StatusCode) -> None:  # noqa: N802
        with self._cv:
            self._code = StatusCode(code)
            self._cv.notify_all()

    def SetMessage(self, message: str) -> None:  # noqa: N802
        with self._cv:
            self._msg = message

    def Update(self, code: StatusCode, message: str) -> None:  # noqa: N802
        with self._cv:
            if self._code > StatusCode.ERR_BEGIN:
                return
            self._code = StatusCode(code)
            self._msg = message
            self._cv.notify_all()

    def WaitFor(self, timeout_ms: int = -1) -> StatusCode:  # noqa: N802
        with self._cv:
            if timeout_ms < 0:
                self._cv.wait_for(lambda: self._code != StatusCode.IN_PROGRESS)
            elif timeout_ms > 0:
                self._cv.wait_for(
                    lambda: self._code != StatusCode.IN_PROGRESS, timeout_ms / 1000
                )
            return self._code

    def Wait(self) -> None:  # noqa: N802
        self.WaitFor(-1)


def _packb(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj))


# -- memory ---------------------------------------------------------------


def file_backing(ptr: int, size: int) -> tuple[str, int] | None:
    """(path, offset in the file) of a shared file mapping holding
    ``[ptr, ptr + size)`` in this process, or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if not lo <= ptr < hi:
                continue
            path = fields[5].strip() if len(fields) == 6 else ""
            if (
                ptr + size > hi
                or "s" not in fields[1]
                or not path.startswith("/")
                or path.endswith("(deleted)")
            ):
                return None
            return path, int(fields[2], 16) + (ptr - lo)
    return None


def _local_bytes(ptr: int, size: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))


class _Mapped:
    """A remote engine's region, mapped from its backing file."""

    def __init__(self, path: str, offset: int, length: int) -> None:
        page = mmap.ALLOCATIONGRANULARITY
        start = offset - offset % page
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, length + (offset - start), offset=start)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)[offset - start :]


@dataclass
class _Region:
    desc: MemoryDesc
    backing: tuple[str, int] | None


# -- control plane (loopback TCP, msgpack frames) ---------------------------


def _send(sock: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    head = _recv_exact(sock, 4)
    return msgpack.unpackb(_recv_exact(sock, struct.unpack("!I", head)[0]))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("control plane connection closed")
        buf += chunk
    return bytes(buf)


class _ControlPlane(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, engine: IOEngine, host: str, port: int) -> None:
        self.engine = engine
        super().__init__((host, port), _ControlHandler)
        self.thread = threading.Thread(
            target=self._accept, name="mori-standin-control", daemon=True
        )
        self.thread.start()

    def _accept(self) -> None:
        """Serve each connection on a thread of its own until ``close``
        (not ``serve_forever``, whose shutdown waits out a poll interval)."""
        while True:
            try:
                request, address = self.socket.accept()
            except OSError:
                return
            self.process_request(request, address)

    def close(self) -> None:
        """Stop at once: an ``accept`` blocked on a socket shut down returns
        with an error."""
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        self.server_close()


class _ControlHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _ControlPlane = self.server  # type: ignore[assignment]
        try:
            while True:
                request = _recv(self.request)
                _send(self.request, server.engine._answer(request))
        except ConnectionError:
            return


# -- engine -------------------------------------------------------------


@dataclass
class LoopbackStats:
    """What this engine moved as the initiator: bytes of completed READs and
    WRITEs, completed batches, batches refused at post."""

    bytes_read: int = 0
    bytes_written: int = 0
    batches: int = 0
    failed_batches: int = 0
    faulted_posts: int = 0
    """Posts a transport fault failed, left pending or cut short."""


@dataclass
class _Post:
    status: TransferStatus
    dst: np.ndarray
    src: np.ndarray
    dst_offsets: list[int]
    src_offsets: list[int]
    sizes: list[int]
    is_read: bool
    fail_after: int | None = None
    """A transport fault: move only this many bytes, in run order, then
    fail."""
    lie: bool = False
    """Report success anyway (the ``lie`` fault)."""


def _pending(first_error: StatusCode) -> StatusCode:
    """WaitAll's verdict at its deadline: a failure wins over pending."""
    return first_error if first_error != StatusCode.SUCCESS else StatusCode.IN_PROGRESS


def _offsets(name: str, values: Sequence[Any]) -> list[int]:
    out = []
    for v in values:
        i = int(v)
        if i != v or i < 0:
            raise TypeError(f"{name}: {v!r} is not a size_t")
        out.append(i)
    return out


class IOEngineSession:
    """A transfer context between one local and one remote region."""

    def __init__(self, engine: IOEngine, local: np.ndarray, remote: np.ndarray) -> None:
        self._engine = engine
        self._local = local
        self._remote = remote

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def read(
        self, local_offset: int, remote_offset: int, size: int, transfer_uid: int
    ) -> TransferStatus:
        return self.batch_read([local_offset], [remote_offset], [size], transfer_uid)

    def write(
        self, local_offset: int, remote_offset: int, size: int, transfer_uid: int
    ) -> TransferStatus:
        return self.batch_write([local_offset], [remote_offset], [size], transfer_uid)

    def batch_read(self, lo: Ints, ro: Ints, sz: Ints, uid: int) -> TransferStatus:
        """Remote -> local: ``sz[i]`` bytes from ``ro[i]`` to ``lo[i]``."""
        return self._engine._post(self._local, self._remote, lo, ro, sz, True)

    def batch_write(self, lo: Ints, ro: Ints, sz: Ints, uid: int) -> TransferStatus:
        """Local -> remote: ``sz[i]`` bytes from ``lo[i]`` to ``ro[i]``."""
        return self._engine._post(self._local, self._remote, lo, ro, sz, False)

    def alive(self) -> bool:
        return True


class IOEngine:
    def __init__(self, key: str, config: IOEngineConfig) -> None:
        self._config = IOEngineConfig(config.host, config.port)
        self._desc = EngineDesc(
            key=key,
            node_id=socket.gethostname(),
            hostname=socket.gethostname(),
            host=config.host,
            port=config.port,
            pid=os.getpid(),
        )
        self._backends: dict[BackendType, Any] = {}
        self._remote_engines: dict[str, EngineDesc] = {}
        self._regions: dict[int, _Region] = {}
        self._mem_ids = itertools.count()
        self._uids = itertools.count()
        self._lock = threading.Lock()
        self._control: _ControlPlane | None = None
        self._mapped: dict[tuple[str, int], _Mapped] = {}
        self._fault_posts: dict[str, int] = {}
        """Posts made so far per faulted request."""
        self._never: list[TransferStatus] = []
        """Statuses a transport fault keeps pending for good."""
        self._queue: queue.Queue[_Post | None] = queue.Queue()
        """Posts for the completion thread; None ends it."""
        self._worker = threading.Thread(
            target=self._complete_posts, name="mori-standin-cq", daemon=True
        )
        self._worker.start()
        self.loopback_stats = LoopbackStats()

    # engine and backends

    def get_engine_desc(self) -> EngineDesc:
        return EngineDesc(**vars(self._desc))

    def create_backend(self, type: BackendType, config: Any = None) -> None:
        if type not in (BackendType.RDMA, BackendType.XGMI):
            raise NotImplementedError("backend not implemented yet")
        if type in self._backends:
            return
        if self._control is None:
            host = self._config.host or "127.0.0.1"
            if host not in _LOOPBACK_HOSTS:
                raise RuntimeError(
                    f"mori loopback stand-in: control plane host {host!r} is not "
                    "a loopback address"
                )
            try:
                self._control = _ControlPlane(self, host, self._config.port)
            except OSError as exc:
                raise RuntimeError(
                    f"mori loopback stand-in: control plane cannot listen on "
                    f"{host}:{self._config.port}: {exc}"
                ) from exc
            self._desc.port = self._control.server_address[1]
            self._desc.host = host
        self._backends[type] = config

    def remove_backend(self, type: BackendType) -> None:
        self._backends.pop(type, None)

    def register_remote_engine(self, engine_desc: EngineDesc) -> None:
        self._remote_engines[engine_desc.key] = engine_desc

    def deregister_remote_engine(self, engine_desc: EngineDesc) -> None:
        self._remote_engines.pop(engine_desc.key, None)

    # memory

    def register_memory(
        self, ptr: int, size: int, device_id: int, mem_loc: MemoryLocationType
    ) -> MemoryDesc:
        with self._lock:
            desc = MemoryDesc(
                engine_key=self._desc.key,
                id=next(self._mem_ids),
                device_id=device_id,
                data=ptr,
                size=size,
                loc=MemoryLocationType(mem_loc),
            )
            self._regions[desc.id] = _Region(desc, file_backing(ptr, size))
        return desc

    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        if tensor.device.type != "cpu":
            raise RuntimeError("mori loopback stand-in: only CPU tensors")
        nbytes = tensor.nelement() * tensor.element_size()
        device_id = -1 if tensor.device.index is None else tensor.device.index
        return self.register_memory(
            tensor.data_ptr(), nbytes, device_id, MemoryLocationType.CPU
        )

    def deregister_memory(self, mem_desc: MemoryDesc) -> None:
        with self._lock:
            self._regions.pop(mem_desc.id, None)

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """Control plane: a registered region's backing, for a peer."""
        if request.get("op") != "ask_mr":
            return {"ok": False, "error": f"unknown op {request.get('op')!r}"}
        with self._lock:
            region = self._regions.get(request["id"])
        if region is None or region.backing is None:
            return {"ok": False, "length": 0}
        path, offset = region.backing
        return {"ok": True, "path": path, "offset": offset, "length": region.desc.size}

    # transfers

    def allocate_transfer_uid(self) -> int:
        return next(self._uids)

    def create_session(
        self, local_mem: MemoryDesc, remote_mem: MemoryDesc
    ) -> IOEngineSession | None:
        remote_engine = self._remote_engines.get(remote_mem.engine_key)
        if not self._backends or remote_engine is None:
            return None
        with self._lock:
            local = self._regions.get(local_mem.id)
        if local is None or local.desc.engine_key != local_mem.engine_key:
            raise RuntimeError(
                f"mori loopback stand-in: local memory {local_mem.id} is not "
                f"registered with engine {self._desc.key}"
            )
        remote = self._map_remote(remote_engine, remote_mem)
        return IOEngineSession(
            self, _local_bytes(local.desc.data, local.desc.size), remote
        )

    def _map_remote(self, engine: EngineDesc, mem: MemoryDesc) -> np.ndarray:
        with socket.create_connection((engine.host, engine.port), timeout=30) as sock:
            _send(sock, {"op": "ask_mr", "id": mem.id})
            reply = _recv(sock)
        if not reply.get("ok") or reply["length"] != mem.size:
            raise RuntimeError(
                "RdmaBackend::CreateSession: remote MR size mismatch for engine "
                f"{engine.key} memId={mem.id} expected={mem.size} "
                f"got={reply.get('length', 0)}"
            )
        key = (engine.key, mem.id)
        with self._lock:
            mapped = self._mapped.get(key)
            if mapped is None:
                mapped = _Mapped(reply["path"], reply["offset"], reply["length"])
                self._mapped[key] = mapped
        return mapped.array[: mem.size]

    def _post(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        is_read: bool,
    ) -> TransferStatus:
        status = TransferStatus()
        status.SetCode(StatusCode.IN_PROGRESS)
        lo = _offsets("local_offsets", local_offsets)
        ro = _offsets("remote_offsets", remote_offsets)
        sz = _offsets("sizes", sizes)
        if not len(lo) == len(ro) == len(sz):
            status.Update(
                StatusCode.ERR_INVALID_ARGS,
                "lengths of local offsets, remote offsets or sizes mismatch",
            )
            return status
        if not sz:
            status.Update(StatusCode.SUCCESS, "")
            return status
        for i, size in enumerate(sz):
            if size > UINT32_MAX:
                status.Update(
                    StatusCode.ERR_INVALID_ARGS,
                    f"single request size {size} exceeds UINT32_MAX; split it "
                    "before submitting",
                )
                return status
            if lo[i] + size > local.size or ro[i] + size > remote.size:
                status.Update(StatusCode.ERR_INVALID_ARGS, "length out of range")
                with self._lock:
                    self.loopback_stats.failed_batches += 1
                return status
        dst, src = (local, remote) if is_read else (remote, local)
        dst_off, src_off = (lo, ro) if is_read else (ro, lo)
        post = _Post(status, dst, src, dst_off, src_off, sz, is_read)
        if not self._inject(post):
            self._queue.put(post)
        return status

    def _inject(self, post: _Post) -> bool:
        """Apply the transport fault of the request this thread posts for:
        True when the post never completes (nothing to queue)."""
        request_id = getattr(_POSTING, "request_id", None)
        fault = faulted(request_id)
        if fault is None or request_id is None:
            return False
        with self._lock:
            index = self._fault_posts.get(request_id, 0)
            self._fault_posts[request_id] = index + 1
            if fault.kind == "partial" and index % 2:
                return False
            if fault.kind == "drop" and index == 0:
                return False
            if fault.kind == "late" and index != 1:
                return False
            self.loopback_stats.faulted_posts += 1
        if fault.kind == "late":
            time.sleep(LATE_POST_S)
            return False
        if fault.kind in ("hang", "drop"):
            self._never.append(post.status)
            return True
        if fault.kind == "error":
            post.fail_after = 0
        else:
            post.lie = fault.kind == "lie"
            total = sum(post.sizes)
            half = post.sizes[: len(post.sizes) // 2]
            post.fail_after = sum(half) if half else total // 2
        return False

    def _complete_posts(self) -> None:
        while True:
            post = self._queue.get()
            if post is None:
                return
            runs = zip(post.dst_offsets, post.src_offsets, post.sizes, strict=True)
            budget = post.fail_after
            moved = 0
            for d, s, n in runs:
                if budget is not None:
                    n = min(n, budget - moved)
                    if n <= 0:
                        break
                post.dst[d : d + n] = post.src[s : s + n]
                moved += n
            if budget is not None and not post.lie:
                post.status.Update(
                    StatusCode.ERR_RDMA_OP,
                    "mori loopback stand-in: injected transport fault",
                )
                continue
            with self._lock:
                stats = self.loopback_stats
                if post.is_read:
                    stats.bytes_read += moved
                else:
                    stats.bytes_written += moved
                stats.batches += 1
            post.status.Update(StatusCode.SUCCESS, "")

    def wait_all(
        self, statuses: Sequence[TransferStatus], timeout_ms: int = -1
    ) -> StatusCode:
        if not statuses:
            return StatusCode.SUCCESS
        if timeout_ms == 0:
            in_progress = False
            for status in statuses:
                code = status.Code()
                if code == StatusCode.IN_PROGRESS:
                    in_progress = True
                elif code != StatusCode.SUCCESS:
                    return code
            return StatusCode.IN_PROGRESS if in_progress else StatusCode.SUCCESS
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        first_error = StatusCode.SUCCESS
        for status in statuses:
            if deadline is None:
                code = status.WaitFor(-1)
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return _pending(first_error)
                code = status.WaitFor(max(1, int(remaining * 1000)))
                if code == StatusCode.IN_PROGRESS:
                    return _pending(first_error)
            if code != StatusCode.SUCCESS and first_error == StatusCode.SUCCESS:
                first_error = code
        return first_error

    def pop_inbound_transfer_status(
        self, remote_key: str, transfer_uid: int
    ) -> TransferStatus | None:
        """Inbound notifications are not modelled (the connector disables
        them): nothing is ever found."""
        return None

    def shutdown(self) -> None:
        """Stop serving the control plane and end the completion thread once
        the posts before it are done; the remote regions mapped so far are
        let go."""
        if self._control is not None:
            self._control.close()
            self._control = None
        self._queue.put(None)
        with self._lock:
            self._mapped.clear()
