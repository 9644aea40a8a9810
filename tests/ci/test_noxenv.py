"""ci/noxenv.py's pure parts: the recorded seconds a suite run is given,
and which benchmarks `nox -s bench` runs (nox is a stand-in here)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest

from tests.repo import REPO


@pytest.fixture
def noxenv() -> Iterator[ModuleType]:
    with mock.patch.dict(sys.modules, {"nox": mock.MagicMock()}):
        sys.modules.pop("ci.noxenv", None)
        from ci import noxenv as module

        yield module
        sys.modules.pop("ci.noxenv", None)


def test_times_are_the_checkouts_then_this_machines(
    noxenv: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(noxenv, "CACHE", tmp_path)
    checkout = str(noxenv.SUITE_TIMES)
    assert noxenv.times_args() == ("--times", checkout)
    (tmp_path / "suite-times.json").write_text("{}")
    last = str(tmp_path / "suite-times.json")
    assert noxenv.times_args() == ("--times", checkout, "--times", last)


def test_bench_runs_every_script_or_the_one_named(noxenv: ModuleType) -> None:
    session = mock.MagicMock(posargs=[])
    every, args = noxenv.benchmarks(session)
    assert {"suite", "hook_cost"} <= set(every) and args == []
    session = mock.MagicMock(posargs=["suite", "--top", "3"])
    assert noxenv.benchmarks(session) == ({"suite": every["suite"]}, ["--top", "3"])
    session = mock.MagicMock(posargs=["nothing"])
    session.error.side_effect = SystemExit
    with pytest.raises(SystemExit):
        noxenv.benchmarks(session)
    assert "'nothing' is not one of" in session.error.call_args.args[0]


def test_lint_checks_the_files_series_check_lists(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`nox -s lint` takes the overlaid files from `series check --json`,
    run in its own environment (nox's has no msgspec), a line nox merged in
    from stderr before it or not."""
    from vllm_overlay.cli import main
    from vllm_overlay.series.patch_series import load_series

    assert main(["--repo", str(REPO), "series", "check", "--json"]) == 0
    out = capsys.readouterr().out
    with mock.patch.dict(sys.modules, {"nox": mock.MagicMock()}):
        for name in ("ci.noxlint", "ci.noxenv"):
            sys.modules.pop(name, None)
        from ci import noxlint
    for text in (out, "a warning on stderr\n" + out):
        session = mock.MagicMock()
        session.run.return_value = text
        assert noxlint.series_check(session) == load_series(REPO).touched_paths()
        assert session.run.call_args.args[:3] == ("vllm-overlay", "series", "check")
    series = load_series(REPO)
    said = f"series check: ok, {len(series.patches)} patches, series {series.series_id}"
    assert session.log.call_args.args[0] == said


def test_the_side_by_side_installs_share_no_package(noxenv: ModuleType) -> None:
    """The frozen requirements and torch with vLLM install in two pip
    processes at once, each --no-deps: neither may list what the other
    installs."""
    from ci import cpuenv

    frozen = cpuenv.requirement_names(noxenv.REQUIREMENTS[0].read_text().splitlines())
    beside = [noxenv.TORCH, noxenv.TORCH_SETUPTOOLS, "vllm", *noxenv.NO_DEPS]
    assert not frozen & {cpuenv.requirement_name(spec) for spec in beside}


def test_torch_goes_in_without_its_requirements_only_where_they_are_frozen(
    noxenv: ModuleType,
) -> None:
    """torch is installed --no-deps: every requirement of the installed
    torch is in the frozen file or installed beside it."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    from ci import cpuenv

    frozen = cpuenv.requirement_names(noxenv.REQUIREMENTS[0].read_text().splitlines())
    frozen.add(cpuenv.requirement_name(noxenv.TORCH_SETUPTOOLS))
    needed = [Requirement(r) for r in requires("torch") or []]
    needed = [r for r in needed if r.marker is None or r.marker.evaluate()]
    assert needed
    missing = {cpuenv.normalize(r.name) for r in needed} - frozen
    assert not missing


def test_the_bytecode_is_written_by_the_import_of_what_the_suite_imports(
    noxenv: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uv writes no bytecode: the environment's python imports what the
    suite imports with writing on (`vllm_overlay.gate.bytecode`), handed the
    build's stamp, which decides with the imports whether it is current."""
    env = tmp_path / "cpu-vllm"
    env.mkdir()
    monkeypatch.setattr(noxenv, "CPU_ENV", env)
    (env / noxenv.CPU_ENV_STAMP).write_text("build 1")
    session = mock.MagicMock()
    session.run.return_value = "noise\nbytecode: 3 files compiled; ...\n"
    noxenv.compile_cpu_env(session)
    args = session.run.call_args.args
    assert args[0] == str(env / "bin" / "python")
    assert args[1:3] == ("-m", "vllm_overlay.gate.bytecode")
    assert args[3:] == (str(noxenv.ROOT), str(env / noxenv.BYTECODE_STAMP), "build 1")
    session.log.assert_called_once_with("bytecode: 3 files compiled; ...")


def test_without_uv_the_build_stops_before_it_touches_the_environment(
    noxenv: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment due for a rebuild is left as it is when uv is missing
    beside nox: one line says how to install it."""
    env = tmp_path / "cpu-vllm"
    (env / "bin").mkdir(parents=True)
    kept = env / "bin" / "python"
    kept.write_text("an older build")
    monkeypatch.setattr(noxenv, "CPU_ENV", env)
    build = mock.Mock(side_effect=SystemExit)
    monkeypatch.setattr(noxenv, "_build_cpu_env", build)
    real = noxenv.importlib.util.find_spec
    monkeypatch.setattr(
        noxenv.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "uv" else real(name, *a),
    )
    session = mock.MagicMock()
    session.error.side_effect = SystemExit
    with pytest.raises(SystemExit):
        noxenv.cpu_python(session)
    assert kept.is_file() and kept.read_text() == "an older build"
    build.assert_not_called()
    message = session.error.call_args.args[0]
    assert message.startswith("uv is not installed beside nox")
