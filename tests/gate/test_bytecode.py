"""The bytecode the suite's processes need is written by importing what the
suite imports, once per build and set of imports."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.repo import REPO
from vllm_overlay.gate import bytecode

PKG = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"


def test_the_names_are_torch_first_what_the_tests_import_and_vllms_cli() -> None:
    names = bytecode.module_names(REPO)
    assert names[:2] == ["torch", "pytest"]
    assert names[-1] == "vllm.entrypoints.cli.main"
    assert "vllm.v1.core.sched.scheduler" in names and "hypothesis" in names
    assert not any(n.startswith(PKG) for n in names)
    assert not any(n.split(".")[0] in ("tests", "vllm_overlay") for n in names)


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module nobody imported yet, in a process that writes no bytecode."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "fresh_mod_for_bytecode.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.delitem(sys.modules, "fresh_mod_for_bytecode", raising=False)
    names = ["fresh_mod_for_bytecode", "no_such_module_anywhere"]
    monkeypatch.setattr(bytecode, "module_names", lambda root: names)
    return tmp_path / "fresh_mod_for_bytecode.py"


def test_the_imported_files_get_their_bytecode_once_per_key(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stamp = tmp_path / "stamp"
    cached = Path(importlib.util.cache_from_source(str(package)))
    assert bytecode.main([str(tmp_path), str(stamp), "build 1"]) == 0
    assert cached.is_file()
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("bytecode: 1 files compiled;")
    assert stamp.read_text().startswith("build 1\n")

    cached.unlink()
    assert bytecode.main([str(tmp_path), str(stamp), "build 1"]) == 0
    assert not cached.exists()
    assert "current" in capsys.readouterr().out

    # A rebuilt environment: its files have no bytecode yet.
    sys.modules.pop("fresh_mod_for_bytecode")
    assert bytecode.main([str(tmp_path), str(stamp), "build 2"]) == 0
    assert cached.is_file()


def test_wrong_arguments_are_one_line_and_import_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bytecode.main(["only-one"]) == 2
    assert "usage:" in capsys.readouterr().err
    assert bytecode.main([str(tmp_path / "nowhere"), str(tmp_path / "s"), "k"]) == 2
    assert capsys.readouterr().err == (
        f"bytecode: {tmp_path / 'nowhere'}: no tests/ directory to read\n"
    )
    stamp = tmp_path / "missing" / "stamp"
    assert bytecode.main([str(REPO), str(stamp), "k"]) == 2
    assert capsys.readouterr().err == f"bytecode: {stamp.parent}: not a directory\n"
