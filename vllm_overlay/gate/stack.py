"""Run each patch's named tests on the stack levels between the base and the
whole series.

Patch K is proven on the stack below it (patches 1..K-1 on the base: level
K-1) and on the stack with it (level K). `nox -s unit-base` runs the whole
suite on level 0 (the pinned base) and on level N (the whole series); this
module runs the rest: every intermediate level is materialized once, as a
complete MoRIIO package directory, and pytest runs there only the tests that
patch K and patch K+1 name (`Tests` and `Guards`), with vLLM's MoRIIO package
redirected to it (`vllm_overlay.gate.level`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.series.patch_series import Series, SeriesPatch
from vllm_overlay.series.pin import Pin
from vllm_overlay.tree.materialize import materialize

LEVEL_OUTCOMES = "outcomes-level-{k}.json"


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
    """``base``, ``base + 0001``, ``base + 0001..0004``."""
    numbers = [p.name.split("-", 1)[0] for p in series.patches[:k]]
    if not numbers:
        return "base"
    if len(numbers) == 1:
        return f"base + {numbers[0]}"
    return f"base + {numbers[0]}..{numbers[-1]}"


def run_levels(
    root: Path,
    pin: Pin,
    series: Series,
    bases: dict[str, str],
    out: Path,
    *,
    pytest_args: Sequence[str] = (),
    progress: Callable[[str], None] = print,
) -> dict[int, Path]:
    """Materialize and run every intermediate level; returns the outcomes
    file of each level."""
    plan = level_plan(series)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[int, Path] = {}
    for k, entries in plan.items():
        level_dir = out / f"level-{k}"
        materialize(bases, series.upto(k), level_dir)
        moriio_dir = level_dir / pin.module
        outcomes = out / LEVEL_OUTCOMES.format(k=k)
        outcomes.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "pytest", "--rootdir", str(root),
            "-q", "--no-header", "-rN", "--tb=no",
            "-p", "vllm_overlay.gate.outcomes", "--outcomes-json", str(outcomes),
            "-p", "vllm_overlay.gate.level", "--moriio-dir", str(moriio_dir),
            *pytest_args, *entries,
        ]  # fmt: skip
        progress(
            f"level {k}/{len(series.patches)} ({level_label(series, k)}): "
            f"{len(entries)} named tests of {series.patches[k - 1].name} and "
            f"{series.patches[k].name}"
        )
        started = time.monotonic()
        run = subprocess.run(
            cmd,
            cwd=root,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
            capture_output=True,
            text=True,
        )
        lines = [ln for ln in run.stdout.strip().splitlines() if ln.strip()]
        summary = lines[-1].strip("= ") if lines else f"exit {run.returncode}"
        if run.returncode not in (0, 1) or not outcomes.is_file():
            detail = (run.stdout + run.stderr).strip().splitlines()[-12:]
            raise StackRunError(
                f"level {k} ({level_label(series, k)}): pytest exited "
                f"{run.returncode}: " + " | ".join(detail)
            )
        progress(f"  {summary} ({time.monotonic() - started:.0f} s)")
        written[k] = outcomes
    return written
