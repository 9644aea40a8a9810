"""A pytest plugin that writes each test id's CPU seconds to a JSON file.

Loaded with ``-p vllm_overlay.gate.cputime --cputime-json PATH`` by the
suite's shards. On two cores the gate's time is its CPU time, and pytest's
durations are wall seconds shared with every other process: this counts,
per test (setup, call and teardown), the CPU of its own process and of the
child processes it waited for (``own``, ``children``). A child forked by the
warm server (`vllm_overlay.warm`) is that server's, not the test's: it is
not counted. `nox -s bench -- suite` prints the tests that cost the most.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from vllm_overlay.gate.reports import load_struct

if TYPE_CHECKING:  # the CLI imports this module without pytest installed
    import pytest

OPTION = "--cputime-json"


class CpuSeconds(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    own: float  # CPU seconds of the test's process
    children: float  # of the child processes it waited for


class CpuTimes(msgspec.Struct, forbid_unknown_fields=True):
    tests: dict[str, CpuSeconds]


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(OPTION, default=None, help="write CPU seconds per test here")


class _Recorder:
    def __init__(self, path: Path):
        self.path = path
        self.tests: dict[str, CpuSeconds] = {}
        self.started: tuple[float, float] = (0.0, 0.0)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.started = (_cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN))

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        own, children = self.started
        self.tests[nodeid] = CpuSeconds(
            round(_cpu(resource.RUSAGE_SELF) - own, 3),
            round(_cpu(resource.RUSAGE_CHILDREN) - children, 3),
        )

    def pytest_sessionfinish(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(msgspec.json.encode(CpuTimes(self.tests)))


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption(OPTION)
    if path:
        config.pluginmanager.register(_Recorder(Path(path)), "cputime-recorder")


def load_cputimes(path: Path) -> dict[str, CpuSeconds]:
    return load_struct(path, CpuTimes, "CPU times", "a CPU times file").tests
