"""ci/noxenv.py's pure parts: the recorded seconds a suite run is given,
and which benchmarks `nox -s bench` runs (nox is a stand-in here)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest


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
