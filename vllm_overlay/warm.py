"""Python children started warm: forked from a process that has loaded vLLM.

A test run's pool server (`vllm_overlay.gate.pytestpool`) loads vLLM once;
where it serves (``VLLM_OVERLAY_WARM_PYTHON``, its socket, in the child's
environment), `python_command` puts this module in front of a child's
Python arguments: ``python -I -m vllm_overlay.warm -- ARGS`` hands ARGS,
the environment, the working directory and its standard streams to the
server, which forks the child from its loaded state
(`vllm_overlay.gate.warmserver`) when the environment is the one vLLM was
loaded under, and says why not otherwise. The child's exit status becomes
this process's (a signal: killed by the same signal); SIGTERM, SIGINT,
SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 are passed on to it, and a kill of
this process ends it. Refused, or with no server: this process becomes
``python ARGS`` (exec), as if the caller had started it.

Only children whose outcome cannot depend on a fresh start use it (not
vLLM's plugin loading, an interpreter's start-up, a process tree's
lifetime); callers opt in.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Mapping

import msgspec

WARM_ENV = "VLLM_OVERLAY_WARM_PYTHON"  # the server's socket
# A child whose environment names its parent's pid here ends with its parent
# (the byte simulator's zygote, simulate/bytes/lifetime.py): started warm, this
# process takes the child's place under that parent (it is sent SIGTERM,
# which it passes on, when the parent ends), and the child is told the
# process that forked it.
PARENT_ENV = "VLLM_OVERLAY_PARENT_PID"
_PR_SET_PDEATHSIG = 1
# Signals passed on to the child; a kill (SIGKILL) of this process closes
# its connection, and the server kills the child.
FORWARDED = (
    signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
    signal.SIGUSR1, signal.SIGUSR2,
)  # fmt: skip


class WarmRequest(msgspec.Struct, forbid_unknown_fields=True):
    args: list[str]  # Python's arguments: [-P] (-m MODULE | -c CODE) ARGS...
    env: dict[str, str]
    cwd: str
    # PARENT_ENV named the caller's parent: the child gets its own parent's.
    parent_bound: bool = False


class Started(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pid: int


class Exited(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    code: int  # the exit status; -N: killed by signal N


class Cold(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    why: str


Reply = Started | Exited | Cold
REPLY = msgspec.json.Decoder(Reply)


def python_command(env: Mapping[str, str] | None = None) -> list[str]:
    """The interpreter part of a child's command line: this module in front
    when ``env`` (default: this process's) names a server, else Python."""
    where = os.environ if env is None else env
    if not where.get(WARM_ENV):
        return [sys.executable]
    return [sys.executable, "-I", "-m", "vllm_overlay.warm", "--"]


def _cold(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *args])


def _bind_to_parent() -> bool:
    """SIGTERM to this process when its parent ends, if the environment asks
    the child to end with it."""
    if os.environ.get(PARENT_ENV) != str(os.getppid()):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    return True


def _ask(path: str, args: list[str]) -> tuple[socket.socket, Reply]:
    bound = _bind_to_parent()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = WarmRequest(args, dict(os.environ), os.getcwd(), bound)
    socket.send_fds(conn, [msgspec.json.encode(request) + b"\n"], [0, 1, 2])
    return conn, REPLY.decode(_line(conn))


def _line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            return data
        data += chunk
    return data


def main(argv: list[str]) -> None:
    """``-- ARGS``: run ARGS warm, or exec Python with them."""
    args = argv[1:] if argv[:1] == ["--"] else argv
    if not args:
        sys.stderr.write("usage: python -m vllm_overlay.warm -- PYTHON-ARGUMENTS\n")
        sys.exit(2)
    path = os.environ.get(WARM_ENV, "")
    try:
        conn, first = _ask(path, args)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        _cold(args)
        return
    if not isinstance(first, Started):
        conn.close()
        _cold(args)
        return
    pid = first.pid

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        end = REPLY.decode(_line(conn))
    except (msgspec.DecodeError, msgspec.ValidationError):
        end = Cold("the server ended before the child")
    if not isinstance(end, Exited):
        os._exit(1)
    if end.code < 0:
        signal.signal(-end.code, signal.SIG_DFL)
        os.kill(os.getpid(), -end.code)
    os._exit(end.code & 0xFF)


if __name__ == "__main__":
    main(sys.argv[1:])
