"""The level plugin's ``--core-dir``: a child pytest loads the vLLM core
modules of a tree written by ``materialize --core`` in place of the
installed ones, before any conftest imports vLLM."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from vllm_overlay.cli import main
from vllm_overlay.series.pin import Pin

SCHEDULER = "vllm.v1.core.sched.scheduler"
# The probe resolves the scheduler's file before importing it (seconds of
# CPU): without ``--core-dir`` it fails on the installed file, unimported.
PROBE = """
import importlib
import importlib.util

TREE = {tree!r}


def test_scheduler_is_the_trees():
    assert importlib.util.find_spec({name!r}).origin == TREE
    assert importlib.import_module({name!r}).__file__ == TREE
"""


def test_core_dir_loads_the_trees_core_modules(tmp_path: Path, pin: Pin) -> None:
    tree = tmp_path / "tree"
    assert main(["materialize", "--core", "c001", "--out", str(tree)]) == 0
    tests = tmp_path / "probe"
    tests.mkdir()
    scheduler = tree.joinpath("vllm", "v1", "core", "sched", "scheduler.py")
    probe = PROBE.format(tree=scheduler.resolve().as_posix(), name=SCHEDULER)
    (tests / "test_probe.py").write_text(probe)
    args = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
        "--rootdir", str(tests), "-p", "vllm_overlay.gate.level",
        "--moriio-dir", str(tree / pin.module), "--core-dir", str(tree),
        str(tests / "test_probe.py"),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, cwd=tests)
    assert done.returncode == 0, done.stdout[-2000:]
    assert f"vLLM core modules: {tree}" in done.stdout
    # Without it the installed scheduler would load: the probe fails (the
    # MoRIIO package's redirect, vLLM's distributed package imported: seconds
    # of CPU, left out).
    moriio = ("--moriio-dir", str(tree / pin.module))
    without = [a for a in args if a not in ("--core-dir", str(tree), *moriio)]
    done = subprocess.run(without, capture_output=True, text=True, cwd=tests)
    assert done.returncode == 1
    installed = importlib.util.find_spec("vllm")
    assert installed is not None and installed.origin is not None
    origin = Path(installed.origin).parent.joinpath("v1", "core", "sched")
    assert f"{origin / 'scheduler.py'}" in done.stdout
