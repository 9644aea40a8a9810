"""Run each patch's named tests on the stack levels between the base and the
whole series.

Patch K is proven on the stack below it (patches 1..K-1 on the base: level
K-1) and on the stack with it (level K). `nox -s unit-base` runs the whole
suite on level 0 (the pinned base) and on level N (the whole series); this
module runs the rest: every intermediate level is materialized once, as a
complete MoRIIO package directory, and pytest runs there only the tests that
patch K and patch K+1 name (`Tests` and `Guards`), with vLLM's MoRIIO package
redirected to it (`vllm_overlay.gate.level`).

vLLM starts once for all levels: one process (`vllm_overlay.gate.forkserver`)
imports what the levels' tests and the base MoRIIO files import from vLLM
(everything but the MoRIIO package itself, `preload_names`), then forks one
child per level, as many at a time as there are cores, each running pytest
in-process.
"""

from __future__ import annotations

import ast
import os
import subprocess
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import msgspec

from vllm_overlay import warm
from vllm_overlay.errors import OverlayError
from vllm_overlay.gate.imports import collection_imports, third_party
from vllm_overlay.gate.pytestargs import rooted
from vllm_overlay.series.patch_series import Series, SeriesPatch
from vllm_overlay.series.pin import MODULE_PACKAGE, Pin
from vllm_overlay.tree.materialize import materialize

LEVEL_OUTCOMES = "outcomes-level-{k}.json"
RESULTS = "levels-results.json"


class LevelJob(msgspec.Struct, forbid_unknown_fields=True):
    k: int
    label: str
    args: list[str]  # pytest's
    log: str


class LevelPlan(msgspec.Struct, forbid_unknown_fields=True):
    """What `vllm_overlay.gate.forkserver` runs: written by `run_levels`."""

    root: str
    preload: list[str]
    jobs: int  # 0: one per core
    levels: list[LevelJob]


class LevelResults(msgspec.Struct, forbid_unknown_fields=True):
    codes: dict[int, int]  # level -> pytest's exit status


class StackRunError(OverlayError):
    """A level could not be run (pytest failed to start or collect)."""


def named_tests(patch: SeriesPatch) -> list[str]:
    """The test entries a patch's header names, Tests then Guards."""
    return list(dict.fromkeys([*patch.header.tests, *patch.header.guards]))


def level_plan(series: Series) -> dict[int, list[str]]:
    """For each intermediate level K (1 <= K < N): the entries to run there,
    patch K's (the stack with it) and patch K+1's (the stack below it)."""
    patches = series.patches
    return {
        k: list(dict.fromkeys([*named_tests(patches[k - 1]), *named_tests(patches[k])]))
        for k in range(1, len(patches))
    }


def level_label(series: Series, k: int) -> str:
    """``base``, ``base + 0001``, ``base + 0001..0004``; a patch whose number
    is out of the series' order is named alone (``base + 0001..0004, 0036,
    0005``)."""
    numbers = [p.name.split("-", 1)[0] for p in series.patches]
    in_order = [all(n < m for m in numbers[i + 1 :]) for i, n in enumerate(numbers)]
    runs: list[list[str]] = []
    for i, n in enumerate(numbers[:k]):
        if runs and in_order[i] and in_order[i - 1]:
            runs[-1].append(n)
        else:
            runs.append([n])
    if not runs:
        return "base"
    return "base + " + ", ".join(
        r[0] if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs
    )


def inside_moriio(name: str) -> bool:
    return name == MODULE_PACKAGE or name.startswith(MODULE_PACKAGE + ".")


def preload_names(
    root: Path, bases: dict[str, str], entries: Iterable[str]
) -> list[str]:
    """The vLLM modules the levels' tests and the base MoRIIO files import at
    module level, the MoRIIO package left out (each level loads its own),
    then the third-party ones."""
    names: dict[str, None] = {}
    for text in bases.values():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names[node.module] = None
            elif isinstance(node, ast.Import):
                names.update(dict.fromkeys(a.name for a in node.names))
    files = {root / e.split("::", 1)[0] for e in entries}
    for f in sorted(files):
        if f.is_file():
            names.update(dict.fromkeys(sorted(collection_imports(f, root))))
    vllm = [n for n in names if n.split(".")[0] == "vllm" and not inside_moriio(n)]
    return vllm + third_party(names, root)


def run_levels(
    root: Path,
    pin: Pin,
    series: Series,
    bases: dict[str, str],
    out: Path,
    *,
    pytest_args: Sequence[str] = (),
    progress: Callable[[str], None] = print,
    jobs: int = 0,
) -> dict[int, Path]:
    """Materialize and run every intermediate level, ``jobs`` at a time
    (default: one per core); returns the outcomes file of each level."""
    plan = level_plan(series)
    out.mkdir(parents=True, exist_ok=True)
    names = preload_names(root, bases, [e for es in plan.values() for e in es])
    levels: list[LevelJob] = []
    for k, entries in plan.items():
        level_dir = out / f"level-{k}"
        materialize(bases, series.upto(k), level_dir)
        outcomes = out / LEVEL_OUTCOMES.format(k=k)
        outcomes.unlink(missing_ok=True)
        args = [
            *rooted(root), "-p", "no:cacheprovider",
            "-q", "--no-header", "-rN", "--tb=no",
            "-p", "vllm_overlay.gate.outcomes", "--outcomes-json", str(outcomes),
            "-p", "vllm_overlay.gate.level",
            "--moriio-dir", str(level_dir / pin.module),
            *pytest_args, *entries,
        ]  # fmt: skip
        label = (
            f"level {k}/{len(series.patches)} ({level_label(series, k)}): "
            f"{len(entries)} named tests of {series.patches[k - 1].name} and "
            f"{series.patches[k].name}"
        )
        levels.append(LevelJob(k, label, args, str(out / f"level-{k}.log")))
    plan_file = out / "levels-plan.json"
    plan_file.write_bytes(
        msgspec.json.encode(LevelPlan(str(root), names, jobs, levels))
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    module = ["-m", "vllm_overlay.gate.forkserver", str(plan_file)]
    cmd = [*warm.python_command(env), *module]
    with subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    ) as server:  # fmt: skip
        assert server.stdout is not None
        tail: list[str] = []
        for line in server.stdout:
            progress(line.rstrip("\n"))
            tail = [*tail[-11:], line.strip()]
    codes = _codes(out / RESULTS)
    problems: list[str] = []
    written: dict[int, Path] = {}
    for job in levels:
        outcomes = out / LEVEL_OUTCOMES.format(k=job.k)
        code = codes.get(job.k)
        if code in (0, 1) and outcomes.is_file():
            written[job.k] = outcomes
            continue
        log = Path(job.log)
        text = log.read_text(errors="replace") if log.is_file() else ""
        lines = [ln for ln in text.strip().splitlines() if ln.strip()] or tail
        problems.append(
            f"level {job.k} ({level_label(series, job.k)}): pytest exited "
            f"{code if code is not None else 'nowhere'}: " + " | ".join(lines[-12:])
        )
    if problems or server.returncode:
        raise StackRunError(
            "; ".join(problems) or f"the level server exited {server.returncode}"
        )
    return written


def _codes(path: Path) -> dict[int, int]:
    try:
        return msgspec.json.decode(path.read_bytes(), type=LevelResults).codes
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return {}
