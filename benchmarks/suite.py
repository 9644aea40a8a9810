"""Where the gate's time goes: `nox -s lint unit-base`'s phases and its
slowest tests, from the last run's records. A figure, not a test: nothing is
asserted.

The phases (``.nox-reports/gate-phases.json``, written by `nox -s lint`
and `vllm-overlay gate`): lint, the suite with the overlay, what can
differ on the base, the stack levels, revert-red, the export and the byte
sweep; "in turn" adds up those the gate runs one after the other (the
stack levels, removable and the byte sweep run beside the overlay run, off
its path). Beside each, the CPU seconds of its processes (and of the
descendants they waited for); their sum over this machine's cores is a time
no order of the phases beats. The slowest tests: from the JUnit XML of the
overlay and base runs (``.nox-reports/suite-*/times.json``), setup, call and
teardown together, so a slow session fixture shows on the test that set it
up. The tests
that used the most CPU, their own process's and that of the children they
waited for (``cputime.json``): on two cores the gate's time is its CPU
time. Without a record of a gate run it says so (exit status 0).

Usage: python benchmarks/suite.py [--top N] [--reports DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_overlay.gate.cputime import CpuSeconds, load_cputimes  # noqa: E402
from vllm_overlay.gate.phases import PHASES_FILE  # noqa: E402
from vllm_overlay.gate.reports import ReportError  # noqa: E402
from vllm_overlay.gate.sequence import Dirs, steps  # noqa: E402
from vllm_overlay.gate.shards import CPU_TIMES, TIMES, Times, load_times  # noqa: E402

ORDER = (
    "lint",
    "overlay",
    "base",
    "levels",
    "revert-red",
    "removable",
    "export",
    "bytes",
)
RUNS = {"suite-overlay": "overlay", "suite-base": "base"}


class Phases(msgspec.Struct):
    phases: dict[str, float]
    run: str = ""
    cpu: dict[str, float] = {}  # CPU-s of a phase's processes (a newer record)


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:4.1f} s"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--reports", type=Path, default=ROOT / ".nox-reports")
    args = parser.parse_args(argv)
    path = args.reports / PHASES_FILE
    try:
        record = msgspec.json.decode(path.read_bytes(), type=Phases)
    except FileNotFoundError:
        print(f"suite: {path}: no gate run recorded; run `nox -s lint unit-base`")
        return 0
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        print(f"suite: {path}: unreadable ({e})")
        return 1
    phases, cpu = record.phases, record.cpu
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"gate phases ({shown}):")
    names = [*(n for n in ORDER if n in phases), *sorted(set(phases) - set(ORDER))]
    for name in names:
        used = f"  {cpu[name]:7.1f} CPU-s" if name in cpu else ""
        print(f"  {name:<11} {phases[name]:7.1f} s{used}")
    missing = [n for n in ORDER if n not in phases]
    if missing:
        print(f"  not recorded (the run stopped or skipped them): {', '.join(missing)}")
    # The phases run beside the overlay run are not on the gate's path.
    beside = {s.phase for s in steps(Dirs(ROOT), "", "") if s.beside and s.phase}
    total = sum(v for k, v in phases.items() if k not in beside)
    others = ", ".join(n for n in names if n in beside)
    print(
        f"  {'in turn':<11} {total:7.1f} s ({_minutes(total)}; "
        f"{others} beside the overlay run)"
    )
    if cpu:
        # Time on the cores: no schedule ends sooner than their sum over them.
        spent, cores = sum(cpu.values()), os.cpu_count() or 1
        print(
            f"  {'CPU':<11} {spent:7.1f} CPU-s in {len(cpu)} phases' processes: "
            f"at least {_minutes(spent / cores)} on {cores} cores"
        )
    runs: dict[str, Times] = {}
    for directory, label in RUNS.items():
        times = load_times(args.reports / directory / TIMES)
        if times is not None:
            runs[label] = times
            print(
                f"{label} run: {len(times.seconds)} tests, "
                f"{sum(times.seconds.values()):.0f} s of test time in "
                f"{times.wall:.0f} s wall"
            )
    ranked = sorted(
        (
            (s, label, t)
            for label, times in runs.items()
            for t, s in times.seconds.items()
        ),
        reverse=True,
    )[: args.top]
    if ranked:
        print(f"the {len(ranked)} slowest tests (setup + call + teardown):")
        for seconds, label, test in ranked:
            print(f"  {seconds:7.1f} s  {label:<7}  {test}")
    costly = _cpu_hungriest(args.reports, args.top)
    print(
        f"suite: {len(names)} phases, {_minutes(total)} in turn; "
        f"{len(ranked)} slowest tests listed, {costly} by CPU"
    )
    return 0


def _cpu_hungriest(reports: Path, top: int) -> int:
    """Print each run's CPU seconds in its tests and the ``top`` tests that
    used the most (their own process and the children they waited for: on
    two cores the gate's time is CPU time); how many were listed."""
    cpu: dict[str, dict[str, CpuSeconds]] = {}
    for directory, label in RUNS.items():
        path = reports / directory / CPU_TIMES
        if not path.exists():  # a gate run older than the record
            continue
        try:
            cpu[label] = load_cputimes(path)
        except ReportError as e:
            print(f"suite: {e}")
            continue
        own = sum(t.own for t in cpu[label].values())
        children = sum(t.children for t in cpu[label].values())
        print(
            f"{label} run: {own:.0f} CPU-s in its tests' own processes, "
            f"{children:.0f} in the children they waited for"
        )
    ranked = sorted(
        (
            (t.own + t.children, t, label, test)
            for label, tests in cpu.items()
            for test, t in tests.items()
        ),
        key=lambda row: row[0],
        reverse=True,
    )[:top]
    if ranked:
        print(f"the {len(ranked)} tests using the most CPU (own + children):")
        for total, t, label, test in ranked:
            print(
                f"  {total:7.1f} CPU-s ({t.own:.1f} + {t.children:.1f})  "
                f"{label:<7}  {test}"
            )
    return len(ranked)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
