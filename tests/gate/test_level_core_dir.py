"""The level plugin's ``--core-dir``: a child pytest loads the vLLM core
modules of a tree written by ``materialize --core`` in place of the
installed ones, before any conftest imports vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vllm_overlay.cli import main
from vllm_overlay.series.pin import Pin

PROBE = """
import vllm.v1.core.sched.scheduler as scheduler


def test_scheduler_is_the_trees(request):
    assert scheduler.__file__ == request.config.getoption("--core-dir").joinpath(
        "vllm", "v1", "core", "sched", "scheduler.py"
    ).resolve().as_posix()
"""


def test_core_dir_loads_the_trees_core_modules(tmp_path: Path, pin: Pin) -> None:
    tree = tmp_path / "tree"
    assert main(["materialize", "--core", "c001", "--out", str(tree)]) == 0
    tests = tmp_path / "probe"
    tests.mkdir()
    (tests / "test_probe.py").write_text(PROBE)
    args = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
        "--rootdir", str(tests), "-p", "vllm_overlay.gate.level",
        "--moriio-dir", str(tree / pin.module), "--core-dir", str(tree),
        str(tests / "test_probe.py"),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, cwd=tests)
    assert done.returncode == 0, done.stdout[-2000:]
    assert f"vLLM core modules: {tree}" in done.stdout
    # Without it the installed scheduler loads: the probe fails.
    without = [a for a in args if a not in ("--core-dir", str(tree))]
    assert subprocess.run(without, capture_output=True, cwd=tests).returncode == 1
