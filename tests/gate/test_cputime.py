"""`vllm_overlay.gate.cputime`: each test's CPU seconds, its own process's
and the children's it waited for, in a JSON file; a wrong file is one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.repo import REPO
from vllm_overlay.gate.cputime import load_cputimes
from vllm_overlay.gate.reports import ReportError

# Each test burns a fifth of a second of CPU, in its process or in a child
# it waits for, measured by the process itself (no wall clock involved).
TESTS = """
import resource
import subprocess
import sys

BURN = (
    "import resource\\n"
    "def cpu():\\n"
    "    u = resource.getrusage(resource.RUSAGE_SELF)\\n"
    "    return u.ru_utime + u.ru_stime\\n"
    "start = cpu()\\n"
    "while cpu() - start < 0.2:\\n"
    "    sum(range(10_000))\\n"
)


def test_in_its_process():
    exec(BURN, {})


def test_in_a_child():
    subprocess.run([sys.executable, "-c", BURN], check=True)
"""


def test_own_and_children_cpu_per_test(tmp_path: Path) -> None:
    (tmp_path / "test_burn.py").write_text(TESTS)
    out = tmp_path / "cpu.json"
    args = ["-p", "no:cacheprovider", "-q", "-p", "vllm_overlay.gate.cputime"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--cputime-json", str(out)]
        + ["--rootdir", str(tmp_path), str(tmp_path / "test_burn.py")],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    cpu = load_cputimes(out)
    assert sorted(cpu) == [
        "test_burn.py::test_in_a_child",
        "test_burn.py::test_in_its_process",
    ]
    here, child = (
        cpu["test_burn.py::test_in_its_process"],
        cpu["test_burn.py::test_in_a_child"],
    )
    assert here.own >= 0.2 and here.children == 0
    assert child.children >= 0.2 and child.own < child.children


def test_a_file_that_is_not_one_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="cannot read the CPU times"):
        load_cputimes(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"tests": {"t": [1.0]}}')
    with pytest.raises(ReportError, match="not a CPU times file"):
        load_cputimes(tmp_path / "bad.json")
