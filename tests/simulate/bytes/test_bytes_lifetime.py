"""A `vllm-overlay simulate-bytes` run ends with its top process, however
that ends: its zygote and rank processes go, and so do their /dev/shm files.

A real run on one small configuration (a hundred cases: still running when
it is killed) is killed once its ranks hold their KV cache files. The tree
must be gone at once: a zygote that outlived its parent would go on until
writing to its closed stdout fails, seconds later (4 to 5 s on two slow
cores), and only then remove its ranks and their files.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from vllm_overlay import cpuplatform
from vllm_overlay.simulate.bytes.shm import remove_shm, shm_files
from vllm_overlay.warm import PARENT_ENV, WARM_ENV

RUN = [
    "simulate-bytes",
    "--layouts=llama",
    "--modes=read",
    "--tp=1-1",
    "--kv-layouts=LBNHC",
    "--variant=overlay",
    "--lengths=4000-4099",
    "--hits=0",
]
RANKS = 2
START_TIMEOUT = 300.0
"""Importing vLLM in the zygote takes tens of seconds on a loaded machine."""
GONE_WITHIN = 2.0
"""Seconds; stopping the tree takes well under one."""


class Run:
    def __init__(self, top: subprocess.Popen[str]) -> None:
        self.top = top
        self.tree: list[psutil.Process] = []

    def wait_for_ranks(self) -> None:
        """Until the descendants hold ``RANKS`` /dev/shm files (the zygote's
        rank slots)."""
        me = psutil.Process(self.top.pid)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.top.poll() is not None:
                _, err = self.top.communicate()
                pytest.fail(f"the run ended early ({self.top.returncode}): {err}")
            with contextlib.suppress(psutil.Error):
                self.tree = me.children(recursive=True)
            if sum(len(shm_files(p.pid)) for p in self.tree) >= RANKS:
                return
            time.sleep(0.1)
        pytest.fail(f"no {RANKS} /dev/shm files of the ranks in {START_TIMEOUT:g} s")

    def leftovers(self, within: float) -> tuple[list[int], list[str]]:
        """Descendants still running and their files still there, once both
        are gone or ``within`` seconds have passed."""
        deadline = time.monotonic() + within
        while True:
            alive = [p.pid for p in self.tree if _running(p)]
            files = [f for p in self.tree for f in shm_files(p.pid)]
            if (not alive and not files) or time.monotonic() > deadline:
                return alive, files
            time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def run(tmp_path) -> Iterator[Run]:
    env = cpuplatform.cpu_environ()
    env.pop(PARENT_ENV, None)
    # The tree a user's run has: its zygote a child of the top process.
    env.pop(WARM_ENV, None)
    report = tmp_path / "simulate-bytes.json"
    top = subprocess.Popen(
        [sys.executable, "-m", "vllm_overlay.cli", *RUN, f"--report={report}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    started = Run(top)
    try:
        yield started
    finally:
        # Whatever a failing test left behind.
        with contextlib.suppress(ProcessLookupError):
            top.kill()
        top.wait()
        for proc in started.tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
            remove_shm(proc.pid)


def test_sigterm_stops_the_ranks_and_removes_their_files(run):
    run.wait_for_ranks()
    run.top.send_signal(signal.SIGTERM)
    _, err = run.top.communicate(timeout=30)
    assert run.top.returncode == 143
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("error: simulate-bytes: interrupted by SIGTERM;")
    )
    assert run.leftovers(GONE_WITHIN) == ([], [])


def test_the_tree_dies_with_a_killed_top_process(run):
    run.wait_for_ranks()
    run.top.kill()
    run.top.wait()
    assert run.leftovers(GONE_WITHIN) == ([], [])
