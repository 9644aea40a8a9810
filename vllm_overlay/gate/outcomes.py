"""A pytest plugin that writes each test id's outcome to a JSON file.

Loaded with ``-p vllm_overlay.gate.outcomes --outcomes-json PATH`` by the nox
sessions that compare the base and the overlay run for run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from vllm_overlay.gate.reports import TestOutcome, load_struct

if TYPE_CHECKING:  # the CLI imports this module without pytest installed
    import pytest


class Outcomes(msgspec.Struct):
    outcomes: dict[str, TestOutcome]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcomes-json", default=None, help="write outcomes here")


class _Recorder:
    def __init__(self, path: Path):
        self.path = path
        self.outcomes: dict[str, TestOutcome] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        previous = self.outcomes.get(report.nodeid)
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if report.passed:
                outcome: TestOutcome = "passed"
            elif report.skipped:
                outcome = "skipped"
            else:
                outcome = "failed" if report.when == "call" else "error"
            self.outcomes[report.nodeid] = outcome
        elif report.when == "teardown" and report.failed and previous == "passed":
            self.outcomes[report.nodeid] = "error"

    def pytest_sessionfinish(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(msgspec.json.encode(Outcomes(self.outcomes)))


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--outcomes-json")
    if path:
        config.pluginmanager.register(_Recorder(Path(path)), "outcomes-recorder")


def load_outcomes(path: Path) -> dict[str, TestOutcome]:
    return load_struct(path, Outcomes, "outcomes", "an outcomes file").outcomes
