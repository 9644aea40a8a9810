"""A sweep's expected time before it starts and its ETA while it runs."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from vllm_overlay.simulate.cli import previous_wall_seconds
from vllm_overlay.simulate.eta import (
    PROCESS_START,
    duration,
    eta_text,
    expected_seconds,
    seconds_left,
)
from vllm_overlay.simulate.lines import Progress
from vllm_overlay.simulate.procs import SweepOptions, Tally


@pytest.mark.parametrize(
    ("seconds", "said"),
    [(0, "0 s"), (44.6, "45 s"), (59.4, "59 s"), (90, "2 min"), (1199, "20 min")]
    + [(3600, "1 h 00 min"), (3 * 3600 + 5 * 60 + 20, "3 h 05 min")],
)
def test_duration(seconds: float, said: str) -> None:
    assert duration(seconds) == said


def test_seconds_left_holds_the_pace() -> None:
    # A quarter took 100 s: three quarters to go take 300 s.
    assert seconds_left(100, 0.25) == pytest.approx(300)
    # From 10 % to 30 % in 100 s: 70 % to go at 20 % per 100 s.
    assert seconds_left(100, 0.30, since=0.10) == pytest.approx(350)
    assert seconds_left(100, 1.0) == 0


@pytest.mark.parametrize(
    ("elapsed", "fraction", "since"), [(2, 0.5, 0), (100, 0.005, 0), (100, 0.3, 0.3)]
)
def test_too_little_done_is_no_estimate(
    elapsed: float, fraction: float, since: float
) -> None:
    assert seconds_left(elapsed, fraction, since) is None
    assert eta_text(elapsed, fraction, since).endswith("ETA estimating")


def test_eta_text() -> None:
    assert eta_text(60, 0.5) == "50 %, ETA 1 min"
    assert eta_text(60, 1.0) == "100 %, ETA 0 s"


def test_expected_seconds_spreads_the_work_over_the_cores() -> None:
    assert expected_seconds(1000, 0.1, processes=2, cores=2) == PROCESS_START + 50
    # More processes than cores run no faster; one process uses one core.
    assert expected_seconds(1000, 0.1, processes=8, cores=2) == PROCESS_START + 50
    assert expected_seconds(1000, 0.1, processes=1, cores=2) == PROCESS_START + 100


class _Result(msgspec.Struct):
    variant: str
    layout: str


def test_the_tally_line_has_the_share_done_and_the_eta() -> None:
    now = [0.0]
    lines: list[str] = []
    tally = Tally(4, lambda r: r.layout, lines.append, clock=lambda: now[0])
    now[0] = 30.0  # the processes' imports: not part of the pace
    tally(Progress("base", "a", 0, 10))
    now[0] = 90.0
    tally(Progress("base", "a", 10, 10))
    tally(_Result("base", "a"))  # 1 of 4 items in 60 s: 3 more take 180 s
    assert lines[0] == "[0/4 done, 0 %, ETA estimating] base:a 0/10"
    assert lines[-1] == "[1/4 done, 25 %, ETA 3 min] "


def test_expect_says_the_plan_and_its_basis() -> None:
    said: list[str] = []
    options = SweepOptions(announce=said.append)
    options.expect("simulate", "10 cases", 10, 1.0, processes=1)
    assert said[-1] == (
        "simulate: 10 cases; expected about 30 s (1 CPU-s per case on 1 process)"
    )
    options = SweepOptions(announce=said.append, previous_seconds=1190.0)
    options.expect("simulate-bytes", "360 configurations", 6384, 0.4, 2)
    assert said[-1] == (
        "simulate-bytes: 360 configurations; expected about 20 min (the last "
        "run of this selection took 20 min)"
    )


def test_the_previous_wall_time_is_read_from_the_report(tmp_path: Path) -> None:
    report = tmp_path / "simulate.json"
    assert previous_wall_seconds(report) is None
    report.write_text('{"wall_seconds": 12.5, "layouts": []}')
    assert previous_wall_seconds(report) == 12.5
    report.write_text("not json")
    assert previous_wall_seconds(report) is None
