"""`vllm_overlay.gate.pytestpool`: the runs `vllm-overlay removable` forks
from one server find the third-party modules loaded and vLLM not, so each
run loads vLLM (and its MoRIIO and core modules) from its own tree; runs
handed over from several threads each get their own exit status and log."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from vllm_overlay.gate.pytestpool import PoolError, PytestPool
from vllm_overlay.series.pin import MODULE_PACKAGE

ROOT = Path(__file__).resolve().parents[2]

# Checked inside a run: the server's head start holds torch, a module vLLM
# brought in when the probe imported it, and no module of vLLM itself.
CHECKS = """
import sys


def test_torch_is_loaded_and_vllm_is_not():
    assert "torch" in sys.modules
    assert not [m for m in sys.modules if m.split(".")[0] == "vllm"]


def test_fails():
    assert False
"""


def test_runs_find_the_head_start_without_vllm(tmp_path: Path) -> None:
    tests = tmp_path / "test_pool_checks.py"
    tests.write_text(CHECKS)
    codes: dict[str, int] = {}

    def run(name: str, pool: PytestPool) -> None:
        args = ["-p", "no:cacheprovider", "-q", f"{tests}::{name}"]
        codes[name] = pool.run(args, tmp_path / f"{name}.log")

    with PytestPool(ROOT, ["vllm.envs"]) as pool:
        threads = [
            threading.Thread(target=run, args=(name, pool))
            for name in ("test_torch_is_loaded_and_vllm_is_not", "test_fails")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert codes == {"test_torch_is_loaded_and_vllm_is_not": 0, "test_fails": 1}
    assert (
        "1 passed"
        in (tmp_path / "test_torch_is_loaded_and_vllm_is_not.log").read_text()
    )
    assert "1 failed" in (tmp_path / "test_fails.log").read_text()
    assert pool.ready is not None and pool.ready.modules > 0


INSTALLED_CHECKS = f"""
import sys


def test_vllm_is_loaded_and_its_moriio_package_is_not():
    assert "vllm.envs" in sys.modules
    assert not [m for m in sys.modules if m.startswith("{MODULE_PACKAGE}")]
"""


def test_the_suites_runs_find_vllm_loaded_but_not_its_moriio_package(
    tmp_path: Path,
) -> None:
    """``installed``: the server imports the installed vLLM's modules the
    runs name, all but the MoRIIO package each run loads itself."""
    tests = tmp_path / "test_installed_checks.py"
    tests.write_text(INSTALLED_CHECKS)
    args = ["-p", "no:cacheprovider", "-q", str(tests)]
    with PytestPool(ROOT, ["vllm.envs"], installed=True) as pool:
        assert pool.run(args, tmp_path / "run.log") == 0, (
            tmp_path / "run.log"
        ).read_text()


def test_a_name_that_loads_the_moriio_package_stops_the_server(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    name = f"{MODULE_PACKAGE}.moriio_common"
    args = ["-p", "no:cacheprovider", "-q", str(tmp_path)]
    with (
        PytestPool(ROOT, ["vllm.envs", name], installed=True) as pool,
        pytest.raises(PoolError, match="exited 1"),
    ):
        pool.run(args, tmp_path / "run.log")
    assert f"importing {name} loaded vLLM's MoRIIO package" in capfd.readouterr().err


WARM_CHECKS = """
import subprocess, sys
from vllm_overlay.warm import python_command


def test_a_python_child_starts_with_vllm_loaded():
    code = "import sys; print('vllm.envs' in sys.modules)"
    cmd = [*python_command(), "-c", code]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.stdout == "True\\n", done.stderr
"""


def test_the_suites_runs_start_their_python_children_warm(tmp_path: Path) -> None:
    """A run's child started through `vllm_overlay.warm` is forked from the
    server's loaded vLLM (a fresh Python would not have it loaded), and the
    log says so; the server's socket directory goes with the server."""
    tests = tmp_path / "test_warm_checks.py"
    tests.write_text(WARM_CHECKS)
    log = tmp_path / "warm.log"
    args = ["-p", "no:cacheprovider", "-q", str(tests)]
    with PytestPool(ROOT, ["vllm.envs"], installed=True, warm_log=log) as pool:
        code = pool.run(args, tmp_path / "run.log")
    assert code == 0, (tmp_path / "run.log").read_text()
    assert log.read_text() == "warm\t-c\n"


TMP_CHECKS = """
import os


def test_writes_a_temporary_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with open(os.environ["WHERE_TMP_WAS"], "w") as out:
        out.write(str(tmp_path))
"""


def test_a_runs_temporary_directories_go_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked run skips pytest's exit handlers, which free its numbered
    directory for the next runs to remove: the run removes its own."""
    tests = tmp_path / "test_tmp_checks.py"
    tests.write_text(TMP_CHECKS)
    monkeypatch.setenv("WHERE_TMP_WAS", str(tmp_path / "where"))
    args = ["-p", "no:cacheprovider", "-q", str(tests)]
    with PytestPool(ROOT, ["vllm.envs"], installed=True) as pool:
        assert pool.run(args, tmp_path / "run.log") == 0
    where = Path((tmp_path / "where").read_text())
    assert where.name == "test_writes_a_temporary_file0"
    assert not where.exists() and not where.parent.exists()
