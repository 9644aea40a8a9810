"""Where the gate's time goes: `nox -s lint unit-base`'s phases and its
slowest tests, from the last run's records. A figure, not a test: nothing is
asserted.

The phases (``.nox-reports/gate-phases.json``, written by `nox -s lint`
and `vllm-overlay gate`): lint, the suite with the overlay, what can
differ on the base, the stack levels, revert-red, the export and the byte
sweep; "in turn" adds up those the gate runs one after the other (the
stack levels, removable and the byte sweep run beside the overlay run, off
its path). The slowest tests: from the JUnit XML of the overlay and base runs
(``.nox-reports/suite-*/times.json``), setup, call and teardown together,
so a slow session fixture shows on the test that set it up. Without a
record of a gate run it says so (exit status 0).

Usage: python benchmarks/suite.py [--top N] [--reports DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_overlay.gate.phases import PHASES_FILE  # noqa: E402
from vllm_overlay.gate.sequence import Dirs, steps  # noqa: E402
from vllm_overlay.gate.shards import TIMES, Times, load_times  # noqa: E402

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


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:4.1f} s"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--reports", type=Path, default=ROOT / ".nox-reports")
    args = parser.parse_args(argv)
    path = args.reports / PHASES_FILE
    try:
        phases = msgspec.json.decode(path.read_bytes(), type=Phases).phases
    except FileNotFoundError:
        print(f"suite: {path}: no gate run recorded; run `nox -s lint unit-base`")
        return 0
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        print(f"suite: {path}: unreadable ({e})")
        return 1
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"gate phases ({shown}):")
    names = [*(n for n in ORDER if n in phases), *sorted(set(phases) - set(ORDER))]
    for name in names:
        print(f"  {name:<11} {phases[name]:7.1f} s")
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
    print(
        f"suite: {len(names)} phases, {_minutes(total)} in turn; "
        f"{len(ranked)} slowest tests listed"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
