"""pytest runs in forked children of one process that imported their
third-party modules once (`vllm-overlay removable`, `vllm-overlay suite`).

In `removable` each run loads vLLM's MoRIIO package and core modules from a
tree of its own (`vllm_overlay.gate.level`), before vLLM imports them: the
server (``python -m vllm_overlay.gate.pytestpool``) never imports vLLM. A
probe child imports the vLLM modules the runs need and lists the other
modules that brought in (torch, transformers, pydantic, ...); the server
imports those, then forks one child per run, which runs pytest in-process
and loads vLLM itself. The suite's runs read the installed vLLM
(``installed``): the server imports the vLLM modules they need itself, all
but its MoRIIO package, which each run loads (and the evidence of
`vllm_overlay.gate.touch` sees loaded) itself. ``PytestPool`` starts the
server and hands it runs from any thread, each run's output in a log file of
its own. With a ``warm_log``, the suite's server also forks a copy of its
loaded state that serves the runs' Python children started through
`vllm_overlay.warm` (`vllm_overlay.gate.warmserver`).
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.gate import warmserver
from vllm_overlay.gate.forkserver import child_pytest
from vllm_overlay.gate.stack import inside_moriio
from vllm_overlay.warm import WARM_ENV

# Never imported by the server: what the runs load from their own trees, and
# what imports it.
KEEP_OUT = ("vllm", "vllm_overlay", "tests", "conftest", "__main__", "__mp_main__")
# The runs' environment: one thread per process (the runs and their children
# share the cores), as the simulator's children have (simulate/procs.py), and
# offline from the Hugging Face Hub, as tests/e2e/conftest.py has it: a child
# started warm (vllm_overlay.warm) then loaded what a fresh one would.
RUN_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
# Seconds between looks for a finished run while the server waits for input.
POLL_S = 0.05


class PoolStart(msgspec.Struct, forbid_unknown_fields=True):
    root: str  # the checkout: the runs' working directory
    preload: list[str]  # the vLLM modules the runs import (the probe's)
    # The runs read the installed vLLM: the server loads it too, but for its
    # MoRIIO package.
    installed: bool = False
    # Installed only: the runs' Python children may start warm, forked from
    # the loaded state (vllm_overlay.warm); one line per child in this log.
    warm_log: str = ""


class PoolJob(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    args: list[str]  # pytest's
    log: str


class PoolReady(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    modules: int
    seconds: float


class PoolDone(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    id: int
    code: int  # pytest's exit status (3: it did not run)


class PoolError(OverlayError):
    """The server exited before a run ended."""


def _third_party(name: str, module: object, root: Path) -> bool:
    if name.split(".", 1)[0] in KEEP_OUT:
        return False
    # The checkout's own modules, not the environments it may hold.
    where = Path(getattr(module, "__file__", None) or "/").resolve()
    return not where.is_relative_to(root) or "site-packages" in where.parts


def probe(root: Path, names: Sequence[str]) -> list[str]:
    """In a forked child: import ``names`` (torch and pytest first); the
    modules outside vLLM and the checkout that brought in, in import order."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 1
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            for name in ["torch", "pytest", *names]:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001  (only a head start)
                    continue
            loaded = list(sys.modules.items())
            found = [n for n, m in loaded if _third_party(n, m, root)]
            with os.fdopen(write, "wb") as out:
                out.write(msgspec.json.encode(found))
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as got:
        data = got.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return []
    return msgspec.json.decode(data, type=list[str])


def preload(root: Path, names: Sequence[str]) -> int:
    """Import the third-party modules ``names`` bring in; the number
    imported. A run must find vLLM unloaded."""
    done = 0
    for name in probe(root, names):
        try:
            importlib.import_module(name)
            done += 1
        except Exception:  # noqa: BLE001  (only a head start)
            continue
    loaded = [m for m in sys.modules if m.split(".", 1)[0] == "vllm"]
    if loaded:
        raise PoolError(
            f"preloading the third-party modules imported {loaded[0]}; the runs "
            "could not load vLLM from their trees"
        )
    return done


def preload_installed(names: Sequence[str]) -> int:
    """Import ``names`` of the installed vLLM (torch, if any, and pytest
    first); the number imported. A run must find vLLM's MoRIIO package
    unloaded: a name that loads it stops the server, naming it (leave it
    out of ``names``)."""
    done = 0
    for name in [*(["torch"] if names else []), "pytest", *names]:
        try:
            importlib.import_module(name)
            done += 1
        except Exception:  # noqa: BLE001  (only a head start)
            continue
        if any(inside_moriio(m) for m in sys.modules):
            raise PoolError(
                f"importing {name} loaded vLLM's MoRIIO package, which each run "
                "must load itself"
            )
    return done


def _send(message: PoolReady | PoolDone) -> None:
    os.write(1, msgspec.json.encode(message) + b"\n")


def serve() -> None:
    """Read the start line and the runs from stdin; fork a child per run at
    once; a line on stdout when the modules are loaded and per ended run.
    At the end of the input: wait for the runs, then exit."""
    pending = b""
    while b"\n" not in pending:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        pending += chunk
    line, pending = pending.split(b"\n", 1)
    start = msgspec.json.decode(line, type=PoolStart)
    root = Path(start.root)
    started = time.monotonic()
    if start.installed:
        modules = preload_installed(start.preload)
    else:
        modules = preload(root, start.preload)
    # The preloaded objects out of the collector's sight: a run's full
    # collections no longer walk (and copy, page by page) torch and the rest.
    gc.freeze()
    warm: tuple[int, str] | None = None
    if start.installed and start.warm_log:
        where = Path(tempfile.mkdtemp(prefix="vllm-overlay-warm-"))
        warm = warmserver.start(where, start.warm_log)
        os.environ[WARM_ENV] = warm[1]
    _send(PoolReady(modules, time.monotonic() - started))
    try:
        _serve_runs(root, pending)
    finally:
        if warm is not None:
            _stop(*warm)


def _stop(pid: int, path: str) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    shutil.rmtree(Path(path).parent, ignore_errors=True)


def _serve_runs(root: Path, pending: bytes) -> None:
    running: dict[int, int] = {}  # pid -> run id
    ended = False
    while not ended or running:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            job = msgspec.json.decode(line, type=PoolJob)
            pid = os.fork()
            if pid == 0:
                os.close(0)
                child_pytest(root, job.args, job.log, f"run {job.id}")
            running[pid] = job.id
        if not ended and select.select([0], [], [], POLL_S)[0]:
            chunk = os.read(0, 1 << 16)
            ended = not chunk
            pending += chunk
        while running:
            pid, status = os.waitpid(-1, 0 if ended else os.WNOHANG)
            if pid == 0:
                break
            if pid in running:
                _send(PoolDone(running.pop(pid), os.waitstatus_to_exitcode(status)))


class PytestPool:
    """The server, started by the first run; ``run`` from any thread."""

    def __init__(
        self,
        root: Path,
        preload: Sequence[str],
        *,
        installed: bool = False,
        warm_log: Path | None = None,
    ) -> None:
        self.root, self.preload, self.installed = root, list(preload), installed
        self.warm_log = "" if warm_log is None else str(warm_log)
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.waiting: dict[int, tuple[threading.Event, list[int]]] = {}
        self.next_id = 0
        self.ended = False
        self.ready: PoolReady | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)

    def _start(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, **RUN_ENV, "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-m", "vllm_overlay.gate.pytestpool"]
        self.proc = subprocess.Popen(
            cmd, cwd=self.root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        start = PoolStart(str(self.root), self.preload, self.installed, self.warm_log)
        self._write(msgspec.json.encode(start))
        self.reader.start()
        return self.proc

    def _write(self, line: bytes) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        decoder = msgspec.json.Decoder(PoolReady | PoolDone)
        for line in self.proc.stdout:
            message = decoder.decode(line)
            if isinstance(message, PoolReady):
                self.ready = message
                continue
            with self.lock:
                event, box = self.waiting.pop(message.id)
            box.append(message.code)
            event.set()
        with self.lock:
            self.ended = True
            for event, _ in self.waiting.values():
                event.set()

    def run(self, args: Sequence[str], log: Path) -> int:
        """pytest ``args`` in a child of the server, its output in ``log``;
        its exit status."""
        event, box = threading.Event(), list[int]()
        with self.lock:
            proc = self.proc or self._start()
            if self.ended:
                raise PoolError(f"the pytest server exited {proc.poll()}")
            run_id, self.next_id = self.next_id, self.next_id + 1
            self.waiting[run_id] = (event, box)
            self._write(msgspec.json.encode(PoolJob(run_id, list(args), str(log))))
        event.wait()
        if not box:
            raise PoolError(
                f"the pytest server exited {proc.wait()} before run {run_id} ended"
            )
        return box[0]

    def close(self) -> None:
        """No more runs: the server ends when its runs have."""
        if self.proc is None or self.proc.stdin is None:
            return
        self.proc.stdin.close()
        self.proc.wait()
        self.reader.join()

    def __enter__(self) -> PytestPool:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


if __name__ == "__main__":
    try:
        serve()
    except (PoolError, msgspec.DecodeError, msgspec.ValidationError) as e:
        print(f"pytestpool: {e}", file=sys.stderr)
        sys.exit(1)
