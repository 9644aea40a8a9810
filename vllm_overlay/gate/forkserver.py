"""Run the stack levels' pytest runs from one process that loaded vLLM once.

``python -m vllm_overlay.gate.forkserver PLAN`` (written by
`vllm_overlay.gate.stack.run_levels`): import the plan's vLLM modules (never
the MoRIIO package: each level loads its own from its directory), then fork
one child per level, ``jobs`` at a time; each child runs pytest in-process,
its output in the level's log. Writes each level's exit status beside the
plan (``levels-results.json``) and prints one line per level.
"""

from __future__ import annotations

import gc
import importlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from vllm_overlay.gate.stack import (
    RESULTS,
    LevelJob,
    LevelPlan,
    LevelResults,
    StackRunError,
    inside_moriio,
)


def preload(names: Sequence[str]) -> int:
    """Import ``names`` (torch first: vLLM expects it); a name that is not a
    module, or fails to import, is left to the level that needs it. The
    number imported."""
    done = 0
    for name in ["torch", "pytest", *names]:
        try:
            importlib.import_module(name)
            done += 1
        except Exception:  # noqa: BLE001  (only a head start)
            continue
    loaded = [m for m in sys.modules if inside_moriio(m)]
    if loaded:
        raise StackRunError(
            f"preloading vLLM imported {loaded[0]}; the levels could not load "
            "their own MoRIIO files"
        )
    return done


def child_pytest(root: Path, args: Sequence[str], log: str, name: str) -> None:
    """In a forked child: pytest in-process, its output in ``log``; never
    returns (exit status 3 when pytest did not run). Its temporary
    directories go with it: a forked run ends without pytest's exit
    handlers, which would let the next runs remove them (its default
    ``/tmp/pytest-of-USER/pytest-N`` stay, locked, for three days)."""
    code = 3
    base = ""
    try:
        if not any(a.startswith("--basetemp") for a in args):
            base = tempfile.mkdtemp(prefix="pytest-run-")
            args = [*args, f"--basetemp={base}"]
        os.chdir(root)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        import pytest

        code = int(pytest.main(list(args)))
    except BaseException as e:  # noqa: BLE001  (a child never returns)
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if base:
            shutil.rmtree(base, ignore_errors=True)
        os._exit(code)


def _summary(log: Path, code: int) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip("= ") if lines else f"exit {code}"


def serve(plan: LevelPlan, results: Path) -> dict[int, int]:
    root = Path(plan.root)
    started = time.monotonic()
    done = preload(plan.preload)
    # The preloaded objects out of the collector's sight: a child's full
    # collections no longer walk (and copy, page by page) the whole of vLLM.
    gc.freeze()
    jobs = max(1, plan.jobs or os.cpu_count() or 1)
    print(
        f"levels: vLLM loaded once ({done} modules, {time.monotonic() - started:.0f}"
        f" s); {len(plan.levels)} levels, {jobs} at a time",
        flush=True,
    )
    todo = list(plan.levels)
    running: dict[int, tuple[LevelJob, float]] = {}
    codes: dict[int, int] = {}
    while todo or running:
        while todo and len(running) < jobs:
            job = todo.pop(0)
            print(job.label, flush=True)
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                child_pytest(root, job.args, job.log, f"level {job.k}")
            running[pid] = (job, time.monotonic())
        pid, status = os.wait()
        if pid not in running:
            continue
        job, t0 = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        codes[job.k] = code
        seconds = time.monotonic() - t0
        print(f"  level {job.k}: {_summary(Path(job.log), code)} ({seconds:.0f} s)")
        sys.stdout.flush()
    results.write_bytes(msgspec.json.encode(LevelResults(codes)))
    return codes


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m vllm_overlay.gate.forkserver PLAN", file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        plan = msgspec.json.decode(path.read_bytes(), type=LevelPlan)
        serve(plan, path.parent / RESULTS)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        print(f"forkserver: {path}: {e}", file=sys.stderr)
        return 2
    except StackRunError as e:
        print(f"forkserver: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
