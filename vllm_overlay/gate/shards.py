"""Run the suite (or the selected tests of it) in parallel pytest runs.

`nox -s unit-base` runs the suite with the overlay in shards: pytest runs
forked from one process that loaded vLLM once (all but its MoRIIO package,
`vllm_overlay.gate.pytestpool`), a few at a time (`vllm-overlay suite`: one
more than the cores), the heaviest first, the next one as one ends, so the
cores end together whatever the recorded seconds missed (`plan`). Each
shard writes its outcomes (`vllm_overlay.gate.outcomes`), its evidence of
reading vLLM's installed MoRIIO package (`vllm_overlay.gate.touch`) and a
JUnit XML with every test's duration; then the tests that evidence selects
run on the pinned base, again in shards. Test files that import the MoRIIO package at
collection (`vllm_overlay.gate.imports`) never share a run with the others:
in a process where the package is loaded every test counts as touching it.
The test files that use a session fixture a conftest names in
``SHARED_FIXTURES`` (`shared_groups`) run in one shard, which sets it up
once.
"""

from __future__ import annotations

import ast
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from xml.etree import ElementTree

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.gate.cputime import CpuTimes, load_cputimes
from vllm_overlay.gate.evidence import Touches, encode, load_touches, merge
from vllm_overlay.gate.imports import collection_imports, imports_package, third_party
from vllm_overlay.gate.outcomes import Outcomes, load_outcomes
from vllm_overlay.gate.pytestargs import rooted
from vllm_overlay.gate.pytestpool import PytestPool
from vllm_overlay.gate.reports import TestOutcome
from vllm_overlay.gate.stack import inside_moriio
from vllm_overlay.series.pin import MODULE_PACKAGE
from vllm_overlay.text import count

OUTCOMES = "outcomes.json"
TOUCHES = "touches.json"
TIMES = "times.json"
FILE_TIMES = "file-times.json"
# CPU seconds per test, its own and its waited-for children's (gate/cputime.py).
CPU_TIMES = "cputime.json"
# The warm Python children of the runs, a line each (vllm_overlay.gate.warmserver).
WARM_LOG = "warm.log"
# pytest's exit status when it collected nothing: a shard whose files a
# conftest leaves out; the run as a whole must run something.
NO_TESTS = 5
IDS = "ids.txt"


class ShardError(OverlayError):
    """A shard's pytest failed to start, collect or finish."""


class Times(msgspec.Struct):
    """Seconds per test id (setup, call and teardown), from the JUnit XML."""

    seconds: dict[str, float]
    wall: float = 0.0


class FileTimes(msgspec.Struct, forbid_unknown_fields=True):
    """Seconds per test file (its tests' setup, call and teardown): what a
    run leaves as ``file-times.json`` and the checkout keeps as
    ``ci/suite-times.json``, the weights of a run with no record of its own."""

    files: dict[str, float]


# A test file's own cost beyond its tests' seconds (collection), in seconds.
START = 0.2
# Shards per core: the suite's files in shards of about their seconds over
# this many per core, so that the last shards, dispatched as cores free up,
# are short enough for the cores to end together.
SHARDS_PER_CORE = 6


def test_files(root: Path, paths: Sequence[str]) -> list[Path]:
    """The test files under ``paths`` (files or directories), as pytest
    finds them by default (``test_*.py``). Some may be left out by a
    conftest's ``collect_ignore``: the shards honour it (`targets`)."""
    found: list[Path] = []
    for p in paths:
        path = (root / p).resolve()
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(path.rglob("test_*.py")))
    return list(dict.fromkeys(found))


def targets(root: Path, paths: Sequence[str], files: Sequence[Path]) -> list[str]:
    """What a shard hands pytest: each of ``paths`` that holds one of its
    ``files``. A directory is collected as pytest would without shards (its
    conftests' ``collect_ignore``, ``collect_ignore_glob``), the plugin
    `vllm_overlay.gate.within` keeping the shard's files; a file named in
    ``paths`` stays named, as pytest would run it."""
    chosen: list[str] = []
    for p in paths:
        path = (root / p).resolve()
        if (path.is_dir() and any(f.is_relative_to(path) for f in files)) or (
            path.is_file() and path in files
        ):
            chosen.append(path.relative_to(root.resolve()).as_posix())
    return list(dict.fromkeys(chosen))


def file_seconds(times: Times, ids: Collection[str] | None = None) -> dict[str, float]:
    """Seconds per test file, of the tests in ``ids`` (None: all)."""
    per_file: dict[str, float] = {}
    for test, seconds in times.seconds.items():
        if ids is None or test in ids:
            name = test.split("::", 1)[0]
            per_file[name] = per_file.get(name, 0.0) + seconds
    return per_file


def load_file_seconds(
    path: Path, ids: Collection[str] | None = None
) -> dict[str, float] | None:
    """Seconds per test file from a run's ``times.json`` (per test, limited
    to ``ids``) or a ``file-times.json``; None if unreadable."""
    times = load_times(path)
    if times is not None:
        return file_seconds(times, ids)
    try:
        return msgspec.json.decode(path.read_bytes(), type=FileTimes).files
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def weigh(
    files: Sequence[Path], root: Path, known: dict[str, float]
) -> dict[Path, float]:
    """Each file's expected seconds: its recorded seconds when ``known`` has
    them; else its size at the recorded files' seconds per byte (a new
    file), or at a millisecond per byte when nothing is recorded."""
    rel = {f: f.relative_to(root).as_posix() for f in files}
    sizes = {f: f.stat().st_size if f.is_file() else 0 for f in files}
    recorded = [f for f in files if rel[f] in known]
    size = sum(sizes[f] for f in recorded)
    rate = sum(known[rel[f]] for f in recorded) / size if size else 1e-3
    return {
        f: START + (known[rel[f]] if rel[f] in known else sizes[f] * rate)
        for f in files
    }


def _neighbours(
    files: Sequence[Path], weights: dict[Path, float], target: float
) -> list[list[Path]]:
    """``files`` in path order, cut into runs of about ``target`` seconds
    (a heavier file alone): an area's files share a shard, and the modules
    they import on first use load once."""
    runs: list[list[Path]] = []
    total = 0.0
    for f in sorted(files):
        if runs and runs[-1] and total + weights[f] <= target:
            runs[-1].append(f)
            total += weights[f]
        else:
            runs.append([f])
            total = weights[f]
    return runs


def plan(
    root: Path, files: Sequence[Path], jobs: int, weights: dict[Path, float]
) -> list[list[Path]]:
    """The shards, heaviest first (the order they are handed to the cores):
    the files importing the MoRIIO package at collection never share a
    shard with the others; each group of files sharing a session fixture
    (`shared_groups`) is one shard; the other files, in path order, form
    shards of about the suite's seconds over ``SHARDS_PER_CORE`` per core."""
    target = sum(weights[f] for f in files) / (max(jobs, 1) * SHARDS_PER_CORE)
    loading = [f for f in files if imports_package(f, root, MODULE_PACKAGE)]
    rest = [f for f in files if f not in loading]
    groups = shared_groups(root, rest)
    grouped = {f for group in groups for f in group}
    shards = [
        *_neighbours(loading, weights, target),
        *groups,
        *_neighbours([f for f in rest if f not in grouped], weights, target),
    ]
    return sorted(shards, key=lambda s: (-sum(weights[f] for f in s), s))


SHARED = "SHARED_FIXTURES"
"""A conftest's module-level tuple of fixture names: session fixtures worth
setting up once (a process that imports vLLM), whose test files `plan` keeps
in one pytest process."""


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None


@cache
def shared_fixtures(conftest: Path) -> tuple[str, ...]:
    """The names a conftest lists in ``SHARED_FIXTURES`` (a tuple or list of
    strings at module level), read without importing it."""
    tree = _parse(conftest) if conftest.is_file() else None
    for node in tree.body if tree is not None else []:
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        named = any(isinstance(t, ast.Name) and t.id == SHARED for t in targets)
        if named and isinstance(node.value, ast.Tuple | ast.List):
            return tuple(
                e.value
                for e in node.value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            )
    return ()


def _parameters(path: Path) -> set[str]:
    """The parameter names of every function a test file defines (the
    fixtures its tests and its own fixtures request)."""
    tree = _parse(path)
    names: set[str] = set()
    for node in ast.walk(tree) if tree is not None else []:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            names.update(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
    return names


def shared_groups(root: Path, files: Sequence[Path]) -> list[list[Path]]:
    """The files (two or more) that request one of the ``SHARED_FIXTURES``
    of a conftest above them (in ``root``), by conftest and fixture; a file
    requesting several joins their groups."""
    root = root.resolve()
    groups: list[tuple[set[tuple[Path, str]], list[Path]]] = []
    for f in files:
        wanted = _parameters(f)
        keys: set[tuple[Path, str]] = set()
        directory = f.resolve().parent
        while directory.is_relative_to(root):
            conftest = directory / "conftest.py"
            keys |= {(conftest, n) for n in shared_fixtures(conftest) if n in wanted}
            if directory == root:
                break
            directory = directory.parent
        if not keys:
            continue
        members = [f]
        for group in [g for g in groups if g[0] & keys]:
            groups.remove(group)
            keys |= group[0]
            members += group[1]
        groups.append((keys, members))
    return [sorted(members) for _, members in groups if len(members) > 1]


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


def preload_names(root: Path, files: Sequence[Path]) -> list[str]:
    """The vLLM modules ``files`` import at collection, but for the MoRIIO
    package, then the third-party ones: what the shards' server loads once."""
    names = {n for f in files for n in collection_imports(f, root)}
    vllm = [n for n in names if n.split(".")[0] == "vllm"]
    return sorted(n for n in vllm if not inside_moriio(n)) + third_party(names, root)


def run_shards(
    root: Path,
    out: Path,
    shards: Sequence[Sequence[Path]],
    *,
    jobs: int = 1,
    paths: Sequence[str] = ("tests",),
    pytest_args: Sequence[str] = (),
    touch: bool = False,
    only: Path | None = None,
    progress: Callable[[str], None] = print,
) -> tuple[dict[str, TestOutcome], Touches | None]:
    """Run the shards, ``jobs`` at a time in the order given, each forked
    from one server (`PytestPool`) as a core frees up; merge their outcomes
    (and touches) into ``out``. Each shard is handed the ``paths`` holding
    its files (`targets`). A pytest exit status other than 0, 1 (tests
    failed) or 5 (a conftest left every file out) is an error."""
    out.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[int, list[str]]] = []
    for i, files in enumerate(shards):
        plugins = ["-p", "vllm_overlay.gate.within", "--shard-files",
                   str(out / f"files-{i}.txt")]  # fmt: skip
        (out / f"files-{i}.txt").write_text("".join(f"{f}\n" for f in files))
        if only:
            plugins += ["-p", "vllm_overlay.gate.only", "--only-ids", str(only)]
        if touch:
            plugins += ["-p", "vllm_overlay.gate.touch", "--touch-json",
                        str(out / f"touches-{i}.json")]  # fmt: skip
        args = [
            *rooted(root),
            "-p", "vllm_overlay.gate.outcomes",
            "--outcomes-json", str(out / f"outcomes-{i}.json"),
            "-p", "vllm_overlay.gate.cputime",
            "--cputime-json", str(out / f"cputime-{i}.json"),
            f"--junitxml={out / f'junit-{i}.xml'}", "-o", "junit_family=xunit1",
            *plugins,
            *pytest_args,
            *targets(root, paths, files),
        ]  # fmt: skip
        runs.append((i, args))
    started = time.monotonic()
    problems: list[str] = []
    codes: dict[int, int] = {}
    names = preload_names(root, [f for files in shards for f in files])

    def run(pool: PytestPool, i: int, args: list[str]) -> None:
        t0 = time.monotonic()
        code = pool.run(args, out / f"shard-{i}.log")
        codes[i] = code
        text = (out / f"shard-{i}.log").read_text(errors="replace")
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        for line in lines:
            if line.startswith(("FAILED ", "ERROR ")):
                progress(f"  shard {i}: {line}")
        summary = lines[-1].strip("= ") if lines else f"exit {code}"
        if code == NO_TESTS:
            summary += " (its files are all left out by a conftest or deselected)"
        files = count(len(shards[i]), "test file")
        took = time.monotonic() - t0
        progress(f"  shard {i + 1}/{len(runs)} ({files}, {took:.0f} s): {summary}")
        if code not in (0, 1, NO_TESTS) or not (out / f"outcomes-{i}.json").is_file():
            tail = " | ".join(lines[-8:])
            problems.append(f"shard {i}: pytest exited {code}: {tail}")

    workers = max(1, min(jobs, len(runs)))
    warm_log = out / WARM_LOG
    warm_log.unlink(missing_ok=True)
    with (
        PytestPool(root, names, installed=True, warm_log=warm_log) as pool,
        ThreadPoolExecutor(max_workers=workers) as threads,
    ):
        for done in [threads.submit(run, pool, i, args) for i, args in runs]:
            done.result()
    if problems:
        raise ShardError("; ".join(sorted(problems)))
    if warm_log.is_file():
        progress(warm_summary(warm_log.read_text()))
    outcomes: dict[str, TestOutcome] = {}
    times: dict[str, float] = {}
    cpu = CpuTimes({})
    for k in sorted(codes):
        outcomes.update(load_outcomes(out / f"outcomes-{k}.json"))
        times.update(junit_times(out / f"junit-{k}.xml", root))
        if (out / f"cputime-{k}.json").is_file():
            cpu.tests.update(load_cputimes(out / f"cputime-{k}.json"))
    if codes and not outcomes:
        raise ShardError(f"no test ran in {count(len(codes), 'shard')}")
    (out / OUTCOMES).write_bytes(msgspec.json.encode(Outcomes(outcomes)))
    wall = time.monotonic() - started
    (out / TIMES).write_bytes(msgspec.json.encode(Times(times, wall)))
    (out / CPU_TIMES).write_bytes(msgspec.json.encode(cpu))
    per_file = dict(sorted(file_seconds(Times(times)).items()))
    rounded = {f: round(s, 1) for f, s in per_file.items()}
    (out / FILE_TIMES).write_bytes(
        msgspec.json.format(msgspec.json.encode(FileTimes(rounded)), indent=1) + b"\n"
    )
    touches = None
    if touch:
        touches = merge([load_touches(out / f"touches-{k}.json") for k in codes])
        (out / TOUCHES).write_bytes(encode(touches))
    return outcomes, touches


def warm_summary(log: str) -> str:
    """One line for the warm children's log (`vllm_overlay.gate.warmserver`)."""
    rows = [line.split("\t", 1) for line in log.splitlines() if "\t" in line]
    warm = [what for kind, what in rows if kind == "warm"]
    cold = Counter(what for kind, what in rows if kind == "cold")
    said = f"suite: {count(len(warm), 'Python child', 'Python children')} forked warm"
    if cold:
        reasons = "; ".join(f"{why} ({n})" for why, n in cold.most_common(3))
        said += f", {sum(cold.values())} started cold: {reasons}"
    return said


def load_times(path: Path) -> Times | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=Times)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
