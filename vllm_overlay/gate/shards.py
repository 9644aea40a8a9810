"""Run the suite (or the selected tests of it) in parallel pytest processes.

`nox -s unit-base` runs the suite with the overlay in shards, one pytest
process per core, each writing its outcomes (`vllm_overlay.gate.outcomes`),
its evidence of reading vLLM's installed MoRIIO package
(`vllm_overlay.gate.touch`) and a JUnit XML with every test's duration; then
the tests that evidence selects on the pinned base, again in shards. Test
files that import the MoRIIO package at collection (`vllm_overlay.gate.imports`)
never share a process with the others: in a process where the package is
loaded every test counts as touching it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from xml.etree import ElementTree

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.gate.evidence import Touches, encode, load_touches, merge
from vllm_overlay.gate.imports import imports_package
from vllm_overlay.gate.outcomes import Outcomes, load_outcomes
from vllm_overlay.gate.reports import TestOutcome
from vllm_overlay.series.pin import MODULE_PACKAGE

OUTCOMES = "outcomes.json"
TOUCHES = "touches.json"
TIMES = "times.json"
IDS = "ids.txt"


class ShardError(OverlayError):
    """A shard's pytest failed to start, collect or finish."""


class Times(msgspec.Struct):
    """Seconds per test id (setup, call and teardown), from the JUnit XML."""

    seconds: dict[str, float]
    wall: float = 0.0


def test_files(root: Path, paths: Sequence[str]) -> list[Path]:
    """The test files under ``paths`` (files or directories), as pytest
    finds them by default (``test_*.py``)."""
    found: list[Path] = []
    for p in paths:
        path = (root / p).resolve()
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(path.rglob("test_*.py")))
    return list(dict.fromkeys(found))


def weigh(files: Sequence[Path], root: Path, times: Times | None) -> dict[Path, float]:
    """Each file's expected seconds: from the last run's times when it has
    them, else its size (a proxy)."""
    per_file: dict[str, float] = {}
    for test, seconds in (times.seconds if times else {}).items():
        name = test.split("::", 1)[0]
        per_file[name] = per_file.get(name, 0.0) + seconds
    known = [per_file.get(f.relative_to(root).as_posix()) for f in files]
    if times and all(k is not None for k in known):
        return {f: float(k or 0.0) + 1.0 for f, k in zip(files, known, strict=True)}
    return {f: f.stat().st_size / 1000.0 for f in files}


def pack(weights: dict[Path, float], bins: int) -> list[list[Path]]:
    """Longest first into the lightest bin; each bin in path order."""
    shards: list[tuple[float, list[Path]]] = [(0.0, []) for _ in range(max(bins, 1))]
    for f in sorted(weights, key=lambda f: (-weights[f], f)):
        i = min(range(len(shards)), key=lambda i: shards[i][0])
        total, members = shards[i]
        shards[i] = (total + weights[f], [*members, f])
    return [sorted(m) for _, m in shards if m]


def plan(
    root: Path, files: Sequence[Path], jobs: int, times: Times | None
) -> list[list[Path]]:
    """The shards: the files importing the MoRIIO package at collection apart
    from the others, cores shared by expected time."""
    loading = [f for f in files if imports_package(f, root, MODULE_PACKAGE)]
    others = [f for f in files if f not in loading]
    weights = weigh(files, root, times)
    if not loading or not others:
        return pack(weights, jobs)
    total = sum(weights.values()) or 1.0
    share = sum(weights[f] for f in loading) / total
    bins = min(max(1, round(jobs * share)), max(jobs - 1, 1))
    return [
        *pack({f: weights[f] for f in loading}, bins),
        *pack({f: weights[f] for f in others}, max(jobs - bins, 1)),
    ]


def junit_times(path: Path, root: Path) -> dict[str, float]:
    """Test id -> seconds from a pytest JUnit XML file."""
    times: dict[str, float] = {}
    if not path.is_file():
        return times
    for case in ElementTree.parse(path).iter("testcase"):
        file = case.get("file") or ""
        classname = case.get("classname") or ""
        name = case.get("name") or ""
        if not file:
            parts = classname.split(".")
            file = "/".join(parts) + ".py"
            classes: list[str] = []
            while parts and not (root / file).is_file():
                classes.insert(0, parts.pop())
                file = "/".join(parts) + ".py"
        else:
            mod = file.removesuffix(".py").replace("/", ".")
            classes = [c for c in classname.removeprefix(mod).split(".") if c]
        test = "::".join([file, *classes, name])
        times[test] = times.get(test, 0.0) + float(case.get("time") or 0.0)
    return times


def run_shards(
    root: Path,
    out: Path,
    shards: Sequence[Sequence[Path]],
    *,
    pytest_args: Sequence[str] = (),
    touch: bool = False,
    only: Path | None = None,
    progress: Callable[[str], None] = print,
) -> tuple[dict[str, TestOutcome], Touches | None]:
    """Run every shard at once; merge their outcomes (and touches) into
    ``out``. A pytest exit status other than 0 or 1 (tests failed) is an
    error."""
    out.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[int, subprocess.Popen[bytes], float]] = []
    started = time.monotonic()
    for i, files in enumerate(shards):
        plugins = (
            ["-p", "vllm_overlay.gate.only", "--only-ids", str(only)] if only else []
        )
        if touch:
            plugins += ["-p", "vllm_overlay.gate.touch", "--touch-json",
                        str(out / f"touches-{i}.json")]  # fmt: skip
        cmd = [
            sys.executable, "-m", "pytest", "--rootdir", str(root),
            "-p", "vllm_overlay.gate.outcomes",
            "--outcomes-json", str(out / f"outcomes-{i}.json"),
            f"--junitxml={out / f'junit-{i}.xml'}", "-o", "junit_family=xunit1",
            *plugins,
            *pytest_args,
            *(f.relative_to(root).as_posix() for f in files),
        ]  # fmt: skip
        log = (out / f"shard-{i}.log").open("wb")
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=log)
        log.close()
        procs.append((i, proc, time.monotonic()))
        progress(f"  shard {i}: {len(files)} test files, log {out / f'shard-{i}.log'}")
    problems: list[str] = []
    for i, proc, _ in procs:
        code = proc.wait()
        text = (out / f"shard-{i}.log").read_text(errors="replace")
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        for line in lines:
            if line.startswith(("FAILED ", "ERROR ")):
                progress(f"  shard {i}: {line}")
        summary = lines[-1].strip("= ") if lines else f"exit {code}"
        progress(f"  shard {i}: {summary}")
        if code not in (0, 1) or not (out / f"outcomes-{i}.json").is_file():
            tail = " | ".join(lines[-8:])
            problems.append(f"shard {i}: pytest exited {code}: {tail}")
    if problems:
        raise ShardError("; ".join(problems))
    outcomes: dict[str, TestOutcome] = {}
    times: dict[str, float] = {}
    for i, _, _ in procs:
        outcomes.update(load_outcomes(out / f"outcomes-{i}.json"))
        times.update(junit_times(out / f"junit-{i}.xml", root))
    (out / OUTCOMES).write_bytes(msgspec.json.encode(Outcomes(outcomes)))
    wall = time.monotonic() - started
    (out / TIMES).write_bytes(msgspec.json.encode(Times(times, wall)))
    touches = None
    if touch:
        touches = merge([load_touches(out / f"touches-{i}.json") for i, _, _ in procs])
        (out / TOUCHES).write_bytes(encode(touches))
    return outcomes, touches


def load_times(path: Path) -> Times | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=Times)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
