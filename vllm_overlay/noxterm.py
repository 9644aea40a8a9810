"""SIGTERM to nox, while a session runs the E2E harness, handled like
Ctrl-C (standard library only: the noxfile imports it).

Ctrl-C reaches every process of the terminal's group: the harness tears
down and nox waits for it (the session's `interrupt_timeout`). A SIGTERM
sent to nox alone (a CI job cancelled, `kill PID`) would end nox at once
and leave the harness running with every container. Within
`sigterm_forwarded`, nox passes the SIGTERM on to its children (the harness
handles it like Ctrl-C) and raises KeyboardInterrupt in itself, so nox
waits for the teardown as after Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType


def children(pid: int) -> list[int]:
    """The process ids whose parent is ``pid`` (from /proc; [] elsewhere)."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may hold spaces and parentheses.
        fields = text.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(stat.parent.name))
    return found


@contextlib.contextmanager
def sigterm_forwarded() -> Iterator[None]:
    """Within the block, SIGTERM to this process goes on to its children
    and, the first time, raises KeyboardInterrupt here."""
    raised = [False]

    def handler(signum: int, frame: FrameType | None) -> None:
        for pid in children(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not raised[0]:
            raised[0] = True
            raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
