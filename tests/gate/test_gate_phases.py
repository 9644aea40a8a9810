"""The gate's phase record and `nox -s bench -- suite`, which prints it with
the slowest tests of the last run (figures, nothing asserted on them)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

from tests.repo import REPO
from vllm_overlay.gate.phases import PHASES_FILE, record, timed
from vllm_overlay.gate.shards import CPU_TIMES, TIMES, Times


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_suite", REPO / "benchmarks" / "suite.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_run_keeps_its_phases_and_drops_an_older_runs(tmp_path: Path) -> None:
    path = tmp_path / PHASES_FILE
    record(path, "lint", 10.04, "run-1")
    record(path, "overlay", 300.0, "run-1")
    assert json.loads(path.read_text())["phases"] == {"lint": 10.0, "overlay": 300.0}
    with pytest.raises(RuntimeError), timed(path, "base", "run-2"):
        raise RuntimeError("a failed phase is timed too")
    assert list(json.loads(path.read_text())["phases"]) == ["base"]


def test_the_bench_prints_the_phases_and_the_slowest_tests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, seconds in [
        ("lint", 20.0), ("overlay", 300.0), ("base", 90.0), ("levels", 100.0)
    ]:  # fmt: skip
        record(tmp_path / PHASES_FILE, name, seconds, "run")
    seconds = {f"tests/t.py::test_{i}": float(i) for i in range(20)}
    (tmp_path / "suite-overlay").mkdir()
    (tmp_path / "suite-overlay" / TIMES).write_bytes(
        msgspec.json.encode(Times(seconds, 150.0))
    )
    assert _bench().main(["--reports", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    phases = [line.split()[0] for line in out[1:5]]
    assert phases == ["lint", "overlay", "base", "levels"]
    assert "revert-red, removable, export, bytes" in out[5]
    # The levels run beside the overlay run: not on the gate's path.
    assert out[6].split() == [
        "in",
        "turn",
        "410.0",
        "s",
        "(6",
        "min",
        "50.0",
        "s;",
        "levels",
        "beside",
        "the",
        "overlay",
        "run)",
    ]
    slowest = [line.split()[-1] for line in out if "tests/t.py::" in line]
    assert slowest == [f"tests/t.py::test_{i}" for i in range(19, 4, -1)]
    assert out[-1].startswith("suite: 4 phases, 6 min 50.0 s in turn; 15 slowest")


def test_the_bench_says_when_no_gate_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench().main(["--reports", str(tmp_path)]) == 0
    assert "no gate run recorded" in capsys.readouterr().out


def test_the_bench_prints_the_tests_using_the_most_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both runs' CPU per test, own and children together, most first."""
    record(tmp_path / PHASES_FILE, "overlay", 300.0, "run")
    cpu = {
        "suite-overlay": {"tests/t.py::a": [1.0, 9.0], "tests/t.py::b": [4.0, 0.0]},
        "suite-base": {"tests/t.py::a": [0.5, 6.0]},
    }
    for run, tests in cpu.items():
        (tmp_path / run).mkdir()
        (tmp_path / run / CPU_TIMES).write_text(json.dumps({"tests": tests}))
    assert _bench().main(["--reports", str(tmp_path), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "overlay run: 5 CPU-s in its tests' own processes, 9 in the children" in (
        "\n".join(out)
    )
    at = out.index("the 2 tests using the most CPU (own + children):")
    assert [line.split() for line in out[at + 1 : at + 3]] == [
        ["10.0", "CPU-s", "(1.0", "+", "9.0)", "overlay", "tests/t.py::a"],
        ["6.5", "CPU-s", "(0.5", "+", "6.0)", "base", "tests/t.py::a"],
    ]
    assert out[-1].endswith("0 slowest tests listed, 2 by CPU")


def test_an_unreadable_cpu_record_is_one_line_and_the_rest_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record(tmp_path / PHASES_FILE, "overlay", 300.0, "run")
    (tmp_path / "suite-overlay").mkdir()
    (tmp_path / "suite-overlay" / CPU_TIMES).write_text("{not json")
    assert _bench().main(["--reports", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    bad = [line for line in out if "not a CPU times file" in line]
    assert len(bad) == 1 and bad[0].startswith(f"suite: {tmp_path}")
    assert out[-1].endswith("0 slowest tests listed, 0 by CPU")


# 0.4 CPU seconds, whatever the machine's speed.
BURN = "import time\nwhile time.process_time() < 0.4:\n    pass"


def test_a_timed_phase_records_the_cpu_of_the_children_it_waited_for(
    tmp_path: Path,
) -> None:
    path = tmp_path / PHASES_FILE
    with timed(path, "lint", "run-1"):
        subprocess.run([sys.executable, "-c", BURN], check=True)
    cpu = json.loads(path.read_text())["cpu"]
    assert 0.4 <= cpu["lint"] < 5, cpu
    record(path, "base", 90.0, "run-2", 150.0)
    assert json.loads(path.read_text())["cpu"] == {"base": 150.0}


def test_the_bench_prints_each_phases_cpu_and_what_it_takes_on_the_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / PHASES_FILE
    record(path, "lint", 80.0, "run", 110.0)
    record(path, "overlay", 400.0, "run", 700.0)
    record(path, "base", 150.0, "run")  # a phase without a CPU record
    bench = _bench()
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    assert bench.main(["--reports", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split() for line in out[1:4]] == [
        ["lint", "80.0", "s", "110.0", "CPU-s"],
        ["overlay", "400.0", "s", "700.0", "CPU-s"],
        ["base", "150.0", "s"],
    ]
    floor = [line for line in out if line.split()[0] == "CPU"]
    assert floor == [
        "  CPU           810.0 CPU-s in 2 phases' processes: at least 6 min 45.0 s "
        "on 2 cores"
    ]
