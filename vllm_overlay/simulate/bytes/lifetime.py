"""The byte simulator's process tree ends with its top process, however that
one ends.

``vllm-overlay simulate-bytes`` (the top process) starts its zygotes (one
per variant by default); each zygote forks rank processes, each backing its
KV cache with a /dev/shm file. Every child asks the kernel for a signal when
its parent ends (``PR_SET_PDEATHSIG``): the zygote SIGTERM, which it handles
by killing its ranks and removing their files (it knows their pids and
outlives them), a rank SIGKILL (it has nothing to clean up: its parent does
that). SIGTERM or SIGINT in the top process become ``Interrupted``, so the
sweep stops its zygotes (SIGTERM, then SIGKILL after a grace period) before
it exits with 128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from vllm_overlay.warm import PARENT_ENV  # a child ends with the parent it names

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, through the symbols this process already has loaded:
    ``ctypes.util.find_library`` would run ``ldconfig`` in a subprocess,
    a fork of a large process in every rank."""
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent: int, signum: int) -> None:
    """Have the kernel send ``signum`` to this process when ``parent`` (the
    process, thread in fact, that started it) ends; if it already ended
    before that was armed (this process was reparented), exit now."""
    if sys.platform.startswith("linux"):
        if _libc().prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent:
        os._exit(128 + signum)


def die_with_parent_from_env(signum: int) -> None:
    """``die_with_parent`` for the parent ``PARENT_ENV`` names, if any."""
    parent = os.environ.get(PARENT_ENV)
    if parent:
        die_with_parent(int(parent), signum)


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived in the top process."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Within the block, the first SIGINT or SIGTERM raises ``Interrupted``;
    later ones are ignored, so they cannot cut the teardown short. Outside
    the main thread (no signal handlers there) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if not fired:
            fired.append(signum)
            raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends (a process forked in it
    starts with them blocked too, and must unblock them)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
