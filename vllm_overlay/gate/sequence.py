"""The gate's run order (`vllm-overlay gate`, `nox -s unit-base`).

The suite with the series, spread over the cores by recorded seconds
(ci/suite-times.json, then this machine's last run), recording which tests
read vLLM's installed MoRIIO package; then those tests, and a sample of the
others whose outcomes must not change, on the pinned base; the per-patch
revert-red table and its verdict; the whole export into a temporary
directory (it reads the revert-red and removable reports). Beside the
overlay run, one after the other: each patch's named tests on the stack
levels in between; each connector workaround proven removable with the
core patch its Remove-When names (`removable`: "NNNN removable with core
patch cNNN: yes"); a small byte sweep with the overlay. They read
materialized trees, not the installed package, and they end before the
base goes on: the installed package holds the overlay all the time they
run, as when they ran after the base run. The shared
environment holds the base only while the base run lasts: the overlay goes
back on even when that run fails or is interrupted.

Each step is one `vllm-overlay` process in the checkout, as the noxfile ran
them; `gate --plan` prints the same steps without running any.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import cpuplatform
from vllm_overlay.checkout import REPORT_DIR
from vllm_overlay.gate.phases import PHASES_FILE, record

CACHE_DIR = ".nox-cache"
# Seconds per test file of a gate run (`.nox-reports/suite-overlay/file-times.json`
# copied there): how the gate spreads the suite over the cores from a fresh clone.
SUITE_TIMES = Path("ci") / "suite-times.json"
WHEEL_ENV = "VLLM_OVERLAY_WHEEL"
OLD_WHEEL_ENV = "VLLM_OVERLAY_TEST_OLD_WHEEL"
TEST_WHEELS = (WHEEL_ENV, OLD_WHEEL_ENV)
# The process whose end ends the byte sweep (simulate/bytes/lifetime.py reads it):
# the step's own parent, this process, or the step exits at once.
PARENT_ENV = "VLLM_OVERLAY_PARENT_PID"
# Every step runs vLLM on the overlay's CPU platform, writing no bytecode.
STEP_ENV = {cpuplatform.ENV: "1", "PYTHONDONTWRITEBYTECODE": "1"}
# The slowest tests, so every run shows where the suite's time goes.
SLOWEST = "--durations=15 --durations-min=2"
# Below its patch a property test fails on purpose: report the first failing
# example, do not shrink it (tests/conftest.py).
NO_SHRINK = "--hypothesis-profile=gate"
QUIET = "--no-header -rN --tb=no --continue-on-collection-errors"
# The hybrid and window mechanism layouts, READ at TP 1->1, every hit: real
# workers moving real bytes, about a minute (`nox -s simulate-bytes` runs all).
BYTES_GATE = ("--layouts", "gemma,dsv4,kimi,glm", "--modes", "read", "--tp", "1-1")
EXPORT_PREFIX = "export-check-"


@dataclass(frozen=True)
class Step:
    """One `vllm-overlay` process of the gate."""

    args: tuple[str, ...]  # after `vllm-overlay`
    say: str = ""  # printed before it runs
    phase: str = ""  # its seconds recorded as this phase of the run
    # The wheels at hand ($VLLM_OVERLAY_WHEEL, $VLLM_OVERLAY_TEST_OLD_WHEEL):
    # the test runs get both, the levels and the export the pinned one.
    wheels: tuple[str, ...] = ()
    silent: bool = False  # its output only when it fails
    always: bool = False  # runs even after a step before it failed
    parent: bool = False  # ends with the gate's parent (the byte sweep)
    # Runs beside the steps after it, one such step at a time in order; its
    # output (and its `say`) printed whole when it ends.
    beside: bool = False
    # Starts once every `beside` step before it has ended (and stops the
    # gate if one failed).
    joins: bool = False
    done: str = ""  # printed after it when it succeeds


@dataclass(frozen=True)
class Dirs:
    """Where the gate's runs write, in the checkout."""

    root: Path

    @property
    def reports(self) -> Path:
        return self.root / REPORT_DIR

    @property
    def overlay(self) -> Path:
        return self.reports / "suite-overlay"

    @property
    def base(self) -> Path:
        return self.reports / "suite-base"

    @property
    def levels(self) -> Path:
        return self.reports / "levels"

    @property
    def removable(self) -> Path:
        return self.reports / "removable.json"

    @property
    def cached_times(self) -> Path:
        """This machine's last gate run's seconds per test."""
        return self.root / CACHE_DIR / "suite-times.json"

    @property
    def phases(self) -> Path:
        return self.reports / PHASES_FILE


def recorded_times(dirs: Dirs) -> list[Path]:
    """The recorded seconds that spread the files, later ones winning: the
    checkout's, then this machine's last run's."""
    cached = dirs.cached_times
    return [dirs.root / SUITE_TIMES, *([cached] if cached.is_file() else [])]


def steps(dirs: Dirs, pytest_args: str, export_out: str) -> list[Step]:
    """The gate's processes in order; ``pytest_args`` go to the overlay and
    base runs (the noxfile's arguments after `--`)."""
    more = f" {pytest_args}" if pytest_args else " "
    times = tuple(a for path in recorded_times(dirs) for a in ("--times", str(path)))
    selection = str(dirs.overlay / "selection.json")
    return [
        Step(("apply",)),
        # Beside the overlay run: materialized trees and the pinned wheel,
        # never the installed package, nor another step's report; they end
        # before `apply --revert`.
        Step(
            ("levels", "--out", str(dirs.levels), f"--pytest-args={NO_SHRINK}"),
            say="running each patch's named tests on the stack levels in between",
            phase="levels",
            wheels=(WHEEL_ENV,),
            beside=True,
        ),
        Step(
            ("removable", "--out", str(dirs.removable)),
            say="proving each connector workaround removable with its core patch",
            phase="removable",
            wheels=(WHEEL_ENV,),
            beside=True,
        ),
        Step(
            ("simulate-bytes", *BYTES_GATE, "--variant", "overlay")
            + ("--kv-layouts", "LBNHC")
            + ("--report", str(dirs.reports / "simulate-bytes-gate.json")),
            say="a small byte sweep with the overlay: its verdict gates too",
            phase="bytes",
            parent=True,
            beside=True,
        ),
        Step(
            ("suite", "--out", str(dirs.overlay), f"--pytest-args={SLOWEST}{more}")
            + times,
            say="running the suite with the overlay (which tests read vLLM's MoRIIO)",
            phase="overlay",
            wheels=TEST_WHEELS,
        ),
        Step(("apply", "--revert"), joins=True),
        Step(
            ("suite", "--variant", "base", "--selection", selection)
            + ("--out", str(dirs.base), "--times", str(dirs.overlay / "times.json"))
            + (f"--pytest-args={QUIET} {NO_SHRINK}{more}",),
            say="running what can differ on the pinned base (failures expected)",
            phase="base",
            wheels=TEST_WHEELS,
        ),
        Step(("apply",), always=True),
        Step(
            ("revert-red", "--base-outcomes", str(dirs.base / "outcomes.json"))
            + ("--overlay-outcomes", str(dirs.overlay / "outcomes.json"))
            + ("--touches", str(dirs.overlay / "touches.json"))
            + ("--selection", selection, "--levels", str(dirs.levels)),
            phase="revert-red",
            joins=True,
        ),
        # The whole export, thrown away: a ported test that fails vLLM's ruff,
        # or mails that do not apply in order, fail the gate, not a later export.
        # It reads the reports of revert-red and removable.
        Step(
            ("export", "--out", export_out, "--no-signoff"),
            phase="export",
            wheels=(WHEEL_ENV,),
            silent=True,
            done="unit-base: every patch exports (ruff, git am in stack order)",
        ),
    ]


def prepare(dirs: Dirs) -> list[str]:
    """Keep the last run's seconds per test (they spread this run), remove
    the last run's outputs; what was done, one line each."""
    done = []
    last = dirs.overlay / "times.json"
    if last.is_file():
        dirs.cached_times.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(last, dirs.cached_times)
        done.append(f"kept {last} as {dirs.cached_times}")
    for stale in (dirs.overlay, dirs.base, dirs.levels):
        if stale.exists():
            shutil.rmtree(stale, ignore_errors=True)
            done.append(f"removed the last run's {stale}")
    return done


def step_env(step: Step, env: Mapping[str, str]) -> dict[str, str]:
    out = {**env, **STEP_ENV}
    for name in TEST_WHEELS:
        if name not in step.wheels:
            out.pop(name, None)
    if step.parent:
        out[PARENT_ENV] = str(os.getpid())
    else:
        out.pop(PARENT_ENV, None)
    return out


def command_line(step: Step, python: str = "vllm-overlay") -> str:
    head = [python, "-m", "vllm_overlay.cli"] if python != "vllm-overlay" else [python]
    return shlex.join([*head, *step.args])


# A step's exit status; with ``out`` given, its output goes there (stdout and
# stderr in one), not to the gate's.
Run = Callable[[Step, dict[str, str], list[str] | None], int]
# The CPU seconds of the step this thread ran last, set by `run_step`: its
# process's and those of the descendants it waited for. Its phase records them.
_step_cpu = threading.local()


def _reap(proc: subprocess.Popen[str]) -> int:
    """Wait for ``proc``: its exit status; its CPU seconds into `_step_cpu`."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    _step_cpu.seconds = usage.ru_utime + usage.ru_stime
    return proc.returncode


def run_step(root: Path) -> Run:
    """A step as a process of this Python in ``root``; its exit status. A
    silent step's output (stdout and stderr in one) is printed when it fails."""

    def run(step: Step, env: dict[str, str], out: list[str] | None = None) -> int:
        cmd = [sys.executable, "-m", "vllm_overlay.cli", *step.args]
        pipe = subprocess.PIPE if out is not None or step.silent else None
        proc = subprocess.Popen(
            cmd, cwd=root, env=env, text=True,
            stdout=pipe, stderr=subprocess.STDOUT if pipe else None,
        )  # fmt: skip
        try:
            text = proc.stdout.read() if proc.stdout is not None else ""
            code = _reap(proc)
        except BaseException:
            # As subprocess.run: a moment to end on the same interrupt, then killed.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.25)
            proc.kill()
            proc.wait()
            raise
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
        if out is not None:
            if not step.silent or code:
                out.append(text)
        elif code and step.silent:
            sys.stdout.write(text)
        return code

    return run


@dataclass(frozen=True)
class Outcome:
    failed: Step | None  # the first step that failed, in the gate's order
    status: int
    ran: int


class _Beside:
    """The `beside` steps: a thread running them one after the other while
    the gate's other steps go on; each one's `say` and output printed whole,
    under the timing's lock, when it ends."""

    def __init__(self, run: Run, say: Callable[[str], None], timing: _Timing) -> None:
        self.run, self.say, self.timing = run, say, timing
        self.todo: queue.Queue[tuple[int, Step, dict[str, str]] | None] = queue.Queue()
        self.codes: dict[int, int] = {}  # exit status by position in the gate
        self.stop = threading.Event()  # start no more of them
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while (item := self.todo.get()) is not None:
            i, step, env = item
            if self.stop.is_set() or any(self.codes.values()):
                continue
            out: list[str] = []
            try:
                with self.timing.timed(step):
                    code = self.run(step, env, out)
            except Exception as e:  # the gate must not pass a step it lost
                out.append(f"gate: {command_line(step)} did not run: {e}\n")
                code = 1
            self.codes[i] = code
            with self.timing.lock:
                for line in step.say.splitlines():
                    self.say(line)
                sys.stdout.write("".join(out))
                sys.stdout.flush()
                for line in step.done.splitlines() if not code else []:
                    self.say(line)

    def join(self) -> dict[int, int]:
        """Wait for every step handed over so far; their exit statuses."""
        self.todo.put(None)
        self.thread.join()
        return self.codes


@dataclass(frozen=True)
class _Timing:
    phases: Path
    run_id: str
    lock: threading.Lock

    def timed(self, step: Step) -> _Timed:
        return _Timed(self, step)


class _Timed:
    """A step's seconds as its phase of the run, even if it fails; phases
    recorded one at a time (the `beside` thread records too)."""

    def __init__(self, timing: _Timing, step: Step) -> None:
        self.timing, self.step = timing, step
        self.started = 0.0

    def __enter__(self) -> None:
        self.started = time.monotonic()
        _step_cpu.seconds = None

    def __exit__(self, *exc: object) -> None:
        if self.step.phase:
            seconds = time.monotonic() - self.started
            cpu: float | None = getattr(_step_cpu, "seconds", None)
            with self.timing.lock:
                record(
                    self.timing.phases,
                    self.step.phase,
                    seconds,
                    self.timing.run_id,
                    cpu,
                )


def run_steps(
    todo: Sequence[Step],
    env: Mapping[str, str],
    run: Run,
    say: Callable[[str], None],
    phases: Path,
    run_id: str,
) -> Outcome:
    """Run ``todo`` in order, each phase timed; the `beside` steps in a
    thread of their own, one after the other, while the others go on, up
    to the first `joins` step. After a failure only the ``always`` steps
    (the overlay back on). An interrupt still runs them."""
    timing = _Timing(phases, run_id, threading.Lock())
    beside = _Beside(run, say, timing)
    codes: dict[int, int] = {}
    joined = False
    at = 0
    try:
        for at, step in enumerate(todo):
            if step.joins and not joined:
                codes.update(beside.join())
                joined = True
            failed = any(codes.values()) or any(beside.codes.values())
            if failed and not step.always:
                continue
            if step.beside and not joined:
                beside.todo.put((at, step, step_env(step, env)))
                continue
            with timing.lock:
                for line in step.say.splitlines():
                    say(line)
            with timing.timed(step):
                codes[at] = run(step, step_env(step, env), None)
            if codes[at]:
                beside.stop.set()
            with timing.lock:
                for line in step.done.splitlines() if not codes[at] else []:
                    say(line)
        if not joined:
            codes.update(beside.join())
    except KeyboardInterrupt:
        beside.stop.set()
        for after in [s for s in todo[at + 1 :] if s.always]:
            run(after, step_env(after, env), None)
        raise
    first = min((i for i, code in codes.items() if code), default=None)
    if first is None:
        return Outcome(None, 0, len(codes))
    return Outcome(todo[first], codes[first], len(codes))
