"""Free loopback ports for the e2e tests, each handed out once per test run.

The kernel's free port for ``bind(0)`` stays free only until its server binds
it, so it must not be handed out again in between: not by this process (the
ports it handed out are remembered), not by another pytest-xdist worker (each
port belongs to one worker, by ``owner``) and never 36367, the toy proxy's
fixed discovery port.
"""

from __future__ import annotations

import os
import socket

TOY_PROXY_PORT = 36367
_HANDED_OUT: set[int] = set()


def worker_share() -> tuple[int, int]:
    """(this worker's index, the number of workers); (0, 1) without xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return (int(name[2:]) if name.startswith("gw") else 0), max(count, 1)


def owner(port: int, count: int) -> int:
    """The worker a port belongs to. Linux hands out only odd ports for
    ``bind(0)`` while it has them, so the parity alone would starve worker 0."""
    return (port // 2) % count


def free_port(host: str = "127.0.0.1") -> int:
    index, count = worker_share()
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        mine = owner(port, count) == index and port != TOY_PROXY_PORT
        if mine and port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
