"""A rank's /dev/shm file goes with the rank, even when the rank is killed."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import time
from types import SimpleNamespace
from typing import Any

from vllm_overlay.simulate.bytes.driver import _Leg
from vllm_overlay.simulate.bytes.shm import (
    remove_shm,
    remove_stale_shm,
    shm_files,
    shm_path,
)


def _hold_a_buffer(conn: Any) -> None:
    assert conn.recv()[0] == "start"
    with open(shm_path(os.getpid()), "wb") as f:
        f.truncate(4096)
    conn.send(("ok", None))
    time.sleep(600)


class _Ctx:
    """multiprocessing's fork context, with ranks that only hold a buffer."""

    def __init__(self) -> None:
        self._mp = multiprocessing.get_context("fork")

    def Pipe(self) -> Any:  # noqa: N802 - multiprocessing's name
        return self._mp.Pipe()

    def Process(self, target: Any, args: Any, daemon: bool) -> Any:  # noqa: N802
        return self._mp.Process(target=_hold_a_buffer, args=args, daemon=daemon)


def test_a_killed_rank_leaves_no_shared_memory_file() -> None:
    configs = [SimpleNamespace(fault=None), SimpleNamespace(fault=None)]
    leg = _Leg(_Ctx(), configs, fresh=True)  # type: ignore[arg-type]
    leg.wait_ready()
    paths = [shm_path(proc.pid) for proc in leg.procs]
    assert all(os.path.exists(p) for p in paths)
    os.kill(leg.procs[0].pid, signal.SIGKILL)
    leg.procs[0].join()
    leg.close()
    assert [p for p in paths if os.path.exists(p)] == []


def test_files_of_processes_that_are_gone_are_swept_and_no_other() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    # A rank's own file, a zygote's slot files and their snapshots.
    names = ("", "p0", "d1", "d1-snapshot")
    for pid in (gone.pid, os.getpid()):
        for slot in names:
            with open(shm_path(pid, slot), "wb"):
                pass
    # Another program's file with a name like ours: not a pid.
    other = shm_path(0).removesuffix("0") + "x-1"
    with open(other, "wb"):
        pass
    try:
        removed = remove_stale_shm()
        assert gone.pid in removed and os.getpid() not in removed
        assert shm_files(gone.pid) == []
        assert sorted(shm_files(os.getpid())) == sorted(
            shm_path(os.getpid(), slot) for slot in names
        )
        assert os.path.exists(other)
    finally:
        remove_shm(gone.pid)
        remove_shm(os.getpid())
        os.unlink(other)
    assert shm_files(os.getpid()) == []
