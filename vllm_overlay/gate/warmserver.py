"""The server of warm children (`vllm_overlay.warm`): a process forked from
the pool server once that has loaded vLLM, forking each child from there.

A child is forked warm only when a fresh ``python ARGS`` would have loaded
the same modules: its environment is the server's but for the few
variables read after start-up (`LATE`), its arguments are ``[-P] (-m MODULE | -c
CODE) ...``, and nothing on its ``sys.path`` ahead of the loaded modules
holds another module of their names. Otherwise the reply says why and the
caller starts Python itself. Each request is one line in ``log``: ``warm``
or ``cold``, tab, the module (or ``-c``) or the reason.

Per connection a helper process (forked) starts the child, says its pid,
waits for it and says its exit status; it kills the child when the
connection closes first (the caller was killed).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import os
import runpy
import select
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec

from vllm_overlay.warm import (
    PARENT_ENV,
    WARM_ENV,
    Cold,
    Exited,
    Started,
    WarmRequest,
)

# Read after start-up, or set per child by this server: not compared. Every
# other variable is (this package's too: one names a core tree to load).
LATE = frozenset(
    {"PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PWD", "OLDPWD", "_", "SHLVL",
     "PYTEST_CURRENT_TEST", "PYTEST_VERSION", WARM_ENV,
     # A terminal's size, read when asked (shutil.get_terminal_size); readline
     # sets them when it loads.
     "COLUMNS", "LINES",
     # Read when the byte simulator's zygote starts, and set by _run.
     PARENT_ENV,
     # Read when vLLM first shapes a Mamba cache (mamba_utils), not on import.
     "VLLM_SSM_CONV_STATE_LAYOUT"}
)  # fmt: skip
# The gate's evidence hook: its child part starts with the child (sitecustomize).
HOOK = "VLLM_OVERLAY_TOUCH_"
# Set in a child that has them and the server not, as a fresh start would
# have: vLLM's loggers set up again if loaded (vLLM's own set-up rereads the
# level; unloaded, the child's first import sets them up); glibc's heap
# thresholds by mallopt, the call these variables stand for.
LOG_LEVEL = "VLLM_LOGGING_LEVEL"
MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}
# Seconds between looks at a child while its caller stays connected.
POLL_S = 0.1


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a fresh Python with vLLM could read while loading."""
    return {k: v for k, v in env.items() if k not in LATE and not k.startswith(HOOK)}


class Parsed(msgspec.Struct, frozen=True):
    safe_path: bool  # -P
    module: str  # -m's, or "" for -c
    code: str  # -c's
    rest: list[str]
    tunes: dict[str, str] = {}  # LOG_LEVEL and MALLOPT variables to apply


def parse(args: list[str]) -> Parsed | str:
    """``[-P] (-m MODULE | -c CODE) ARGS...``, or why not."""
    safe = bool(args) and args[0] == "-P"
    rest = args[1:] if safe else args
    if len(rest) >= 2 and rest[0] in ("-m", "-c"):
        if rest[0] == "-m":
            return Parsed(safe, rest[1], "", rest[2:])
        return Parsed(safe, "", rest[1], rest[2:])
    return f"arguments other than [-P] -m/-c: {' '.join(args[:2])}"


def _origin(module: object) -> str:
    where = getattr(module, "__file__", None)
    if where is None:
        paths = list(getattr(module, "__path__", []) or [])
        where = paths[0] if paths else None
    return os.path.realpath(where) if where else ""


def shadowed(entries: list[str], loaded: Mapping[str, str]) -> str:
    """A loaded top-level module another ``sys.path`` entry ahead of the
    environment's would hold (``loaded``: name -> where it was loaded
    from), or ""."""
    for entry in entries:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        base = os.path.realpath(entry or ".")
        for name in names:
            top = name.split(".", 1)[0]
            origin = loaded.get(top)
            if origin is not None and not origin.startswith(base + os.sep):
                return f"{os.path.join(entry, name)} would shadow {top}"
    return ""


class Server:
    """The loaded state children are forked from."""

    def __init__(self, log: str) -> None:
        self.log = log
        self.env = startup_env(os.environ)
        own = os.environ.get("PYTHONPATH", "")
        ours = [p for p in own.split(os.pathsep) if p]
        # sys.path without the server's own first entry and PYTHONPATH.
        self.path = [p for p in sys.path[1:] if p not in ours]
        self.loaded = {
            name: _origin(module)
            for name, module in list(sys.modules.items())
            if "." not in name and _origin(module)
        }

    def refusal(self, request: WarmRequest) -> tuple[Parsed | None, str]:
        parsed = parse(request.args)
        if isinstance(parsed, str):
            return None, parsed
        theirs = startup_env(request.env)
        names = {k for k, _ in set(theirs.items()) ^ set(self.env.items())}
        tunes = {k: theirs[k] for k in names & {LOG_LEVEL, *MALLOPT} if k in theirs}
        if any(not v.isdigit() for k, v in tunes.items() if k in MALLOPT):
            tunes = {}
        left = sorted(names - set(tunes))
        if left:
            return None, f"environment differs in {', '.join(left[:3])}"
        parsed = msgspec.structs.replace(parsed, tunes=tunes)
        ahead = [p for p in request.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if not parsed.safe_path:
            ahead = [request.cwd if parsed.module else "", *ahead]
        where = shadowed([os.path.join(request.cwd, p) for p in ahead], self.loaded)
        return parsed, where

    def note(self, line: str) -> None:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line.replace("\n", " ") + "\n").encode())
        finally:
            os.close(fd)


def _vllm_logging() -> Callable[[], None] | None:
    """vLLM's set-up of its loggers from the environment, if vLLM is loaded."""
    found = getattr(sys.modules.get("vllm.logger"), "_configure_vllm_root_logger", None)
    return found if callable(found) else None


def _tune(tunes: Mapping[str, str]) -> None:
    libc = ctypes.CDLL(None) if tunes.keys() & MALLOPT.keys() else None
    for name, value in tunes.items():
        if name in MALLOPT and libc is not None:
            libc.mallopt(MALLOPT[name], int(value))
    relog = _vllm_logging() if LOG_LEVEL in tunes else None
    if relog is not None:
        relog()


def _send(conn: socket.socket, reply: Started | Exited | Cold) -> None:
    conn.sendall(msgspec.json.encode(reply) + b"\n")


def _run(server: Server, request: WarmRequest, parsed: Parsed) -> int:
    """In the child: the request's Python; its exit status."""
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    if request.parent_bound:
        os.environ[PARENT_ENV] = str(os.getppid())
    sys.dont_write_bytecode = bool(request.env.get("PYTHONDONTWRITEBYTECODE"))
    extra = [p for p in request.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = [] if parsed.safe_path else [os.getcwd() if parsed.module else ""]
    sys.path[:] = [*first, *extra, *server.path]
    _tune(parsed.tunes)
    for entry in extra:  # site imports it at start-up (the gate's evidence hook)
        if os.path.isfile(os.path.join(entry, "sitecustomize.py")):
            sys.modules.pop("sitecustomize", None)
            __import__("sitecustomize")
            break
    try:
        if parsed.module:
            sys.argv = [parsed.module, *parsed.rest]
            # A fresh Python has not imported the module itself (runpy warns
            # if so); a package's runs as its __main__.
            loaded = sys.modules.get(parsed.module)
            if loaded is not None and not hasattr(loaded, "__path__"):
                del sys.modules[parsed.module]
            runpy.run_module(parsed.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *parsed.rest]
            main = {"__name__": "__main__", "__builtins__": builtins}
            exec(compile(parsed.code, "<string>", "exec"), main)  # noqa: S102
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return -signal.SIGINT
    except BaseException:  # noqa: BLE001  (printed, as Python does)
        traceback.print_exc()
        return 1


def _child(
    server: Server, request: WarmRequest, parsed: Parsed, fds: list[int]
) -> None:
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = _run(server, request, parsed)
        threading._shutdown()  # type: ignore[attr-defined]  # as Python ends
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001  (a child never returns)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # closed by the child
                stream.flush()
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def _helper(server: Server, conn: socket.socket, listener: socket.socket) -> None:
    """In a forked helper: one request, start to end; never returns."""
    try:
        listener.close()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not data.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            data += more
        try:
            request = msgspec.json.decode(data, type=WarmRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            server.note(f"cold\tunreadable request: {e}")
            _send(conn, Cold(f"unreadable request: {e}"))
            os._exit(0)
        parsed, why = server.refusal(request)
        if parsed is None or why or len(fds) != 3:
            server.note(f"cold\t{why or 'three standard streams expected'}")
            _send(conn, Cold(why or "three standard streams expected"))
            os._exit(0)
        server.note(f"warm\t{parsed.module or '-c'}")
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(server, request, parsed, fds)
        for fd in fds:
            os.close(fd)
        _send(conn, Started(pid))
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _send(conn, Exited(os.waitstatus_to_exitcode(status)))
                break
            if select.select([conn], [], [], POLL_S)[0] and not conn.recv(1):
                os.kill(pid, signal.SIGKILL)  # the caller is gone
                os.waitpid(pid, 0)
                break
    except BaseException:  # noqa: BLE001  (a helper never returns)
        traceback.print_exc()
    finally:
        os._exit(0)


def serve(listener: socket.socket, log: str) -> None:
    """Accept requests until killed; a forked helper per request."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # the pool server's replies are not ours to hold open
    os.close(null)
    server = Server(log)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        if os.fork() == 0:
            _helper(server, conn, listener)
        conn.close()


def start(directory: Path, log: str) -> tuple[int, str]:
    """Fork the server from this process (its loaded state); its pid and
    socket path."""
    path = str(directory / "warm.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    pid = os.fork()
    if pid == 0:
        try:
            serve(listener, log)
        finally:
            os._exit(0)
    listener.close()
    return pid, path
