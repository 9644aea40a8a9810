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


def shm_path(pid: int, slot: str = "") -> str:
    """A KV cache buffer's file, owned by process ``pid``: a rank process's
    own (no ``slot``), or one of a zygote's rank slots (``p0``, ``d1``: that
    TP rank of the prefill or decode leg), which the rank in that slot of
    each configuration maps in turn (``kvmem._map_file``). A file's
    snapshot file is its name and a suffix.

    The driver removes a rank process's files after the process is gone, and
    a zygote its slots' files when it ends (also when it is stopped by a
    signal, ``driver.kill_ranks``). Only a zygote killed outright (SIGKILL)
    leaves files behind: ``remove_stale_shm`` removes those at the next
    sweep's start and end.
    """
    return f"{SHM_DIR}/{SHM_PREFIX}{pid}" + (f"-{slot}" if slot else "")


def _owner(name: str) -> int | None:
    if not name.startswith(SHM_PREFIX):
        return None
    pid = name.removeprefix(SHM_PREFIX).partition("-")[0]
    return int(pid) if pid.isdigit() else None


def _names() -> list[str]:
    try:
        return os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []


def shm_files(pid: int) -> list[str]:
    """The files process ``pid`` owns."""
    return [f"{SHM_DIR}/{name}" for name in _names() if _owner(name) == pid]


def remove_shm(pid: int) -> None:
    """Remove every file process ``pid`` owns."""
    for path in shm_files(pid):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_shm() -> list[int]:
    """Remove the files whose owner no longer exists (a zombie still does:
    its parent removes its files after reaping it); their owners' pids."""
    owners = {_owner(name) for name in _names()} - {None}
    removed = sorted(pid for pid in owners if pid is not None and not _alive(pid))
    for pid in removed:
        remove_shm(pid)
    return removed
