"""The rank processes' /dev/shm files: where they are and how they go.

Standard library only: the CLI imports it for every sweep, including in
environments without numpy (``vllm-overlay --help`` in a bare virtualenv,
the lint session).
"""

from __future__ import annotations

import contextlib
import os

SHM_DIR = "/dev/shm"
SHM_PREFIX = "vllm-overlay-bytes-"


def shm_path(pid: int) -> str:
    """The file backing rank process ``pid``'s KV cache.

    The rank unlinks it when it closes; the driver unlinks it again after the
    process is gone (also when the zygote is stopped by a signal,
    ``driver.kill_ranks``), so a rank that was killed leaves nothing in
    /dev/shm. Only a zygote killed outright (SIGKILL) leaves its ranks' files:
    ``remove_stale_shm`` removes those at the next sweep's start and end.
    """
    return f"{SHM_DIR}/{SHM_PREFIX}{pid}"


def remove_shm(pid: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shm_path(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_shm() -> list[int]:
    """Remove the rank files whose process no longer exists (a zombie still
    does: its parent removes its file after reaping it); their pids."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        pid = name.removeprefix(SHM_PREFIX)
        if name.startswith(SHM_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            remove_shm(int(pid))
            removed.append(int(pid))
    return removed
