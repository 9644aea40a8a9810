"""What both simulators' process trees share.

A sweep runs one Python process per moriio variant (base, overlay) or per
share of one, each loading its variant's files (``tree.variant``) and writing
one msgspec struct per stdout line after a mark; the parent reads them back,
shows progress, and fails with the process's last lines if it dies.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from vllm_overlay import cpuplatform, warm
from vllm_overlay.checkout import Checkout
from vllm_overlay.simulate.builds import BuildPair, load_pair
from vllm_overlay.simulate.core import load_core_from_env
from vllm_overlay.simulate.eta import (
    duration,
    eta_text,
    expected_line,
    expected_seconds,
)
from vllm_overlay.simulate.lines import Progress
from vllm_overlay.simulate.plan import Sources, sources
from vllm_overlay.text import count
from vllm_overlay.tree.materialize import BaseSource
from vllm_overlay.tree.variant import build_variant_dir

Started = tuple["subprocess.Popen[str]", str]
"""A started process and its label for errors."""

REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_GRACE = 10.0
"""Seconds a process gets to exit after SIGTERM before it is killed."""


@dataclass
class SweepOptions:
    """Where a sweep's variants come from, and where its progress goes."""

    base_source: BaseSource | None = None
    overlay_source: str | None = None
    """``series`` (default), a directory or ``REPO@REF`` (``overlay_files``)."""
    progress: Callable[[str], None] | None = None
    checkout: Checkout | None = None
    announce: Callable[[str], None] | None = None
    """Gets the line saying what the sweep runs and how long it should take."""
    previous_seconds: float | None = None
    """The wall time of the last run of the same selection, if known."""

    def expect(
        self, what: str, plan: str, cases: int, cpu_per_case: float, processes: int
    ) -> None:
        """Announce the plan and its expected time: the last run of the same
        selection's, else ``cases`` at ``cpu_per_case`` on ``processes``."""
        if self.announce is None:
            return
        if self.previous_seconds is not None:
            seconds = self.previous_seconds
            basis = f"the last run of this selection took {duration(seconds)}"
        else:
            cores = os.cpu_count() or 1
            seconds = expected_seconds(cases, cpu_per_case, processes, cores)
            parallel = max(1, min(processes, cores))
            on = count(parallel, "process", "processes")
            basis = f"{cpu_per_case:.3g} CPU-s per case on {on}"
        self.announce(expected_line(what, plan, seconds, basis))

    def sources(self, variants: Sequence[str]) -> Sources:
        """The files of every build the pairs ``variants`` run, by build
        (``plan.sources``)."""
        return sources(variants, self.base_source, self.overlay_source, self.checkout)


class Tally:
    """A sweep's results as its processes report them (one reader thread
    each), and a progress line: items done, the share of the work done
    (items under way count by their cases done), the time left at the pace
    so far, and what each process is on."""

    def __init__(
        self,
        total: int,
        key: Callable[[Any], str],
        progress: Callable[[str], None] | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.results: list[Any] = []
        self._total = total
        self._key = key
        self._progress = progress
        self._busy: dict[tuple[str, str], tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._clock = clock
        # When the first report came, and the share done then: the pace is
        # measured from there (the processes' imports come before it).
        self._first: tuple[float, float] | None = None

    def fraction(self) -> float:
        """The share of the work done: every finished item, and each item
        under way by its cases done."""
        under_way = sum(d / t for d, t in self._busy.values() if t > 0)
        return (len(self.results) + under_way) / max(1, self._total)

    def ordered(self, plan_index: Callable[[Any], int], variants: list[str]) -> Any:
        """The results in plan order, each item's variants side by side."""
        where = {v: i for i, v in enumerate(variants)}
        return sorted(self.results, key=lambda r: (plan_index(r), where[r.variant]))

    def __call__(self, line: Any) -> None:
        with self._lock:
            if isinstance(line, Progress):
                self._busy[(line.variant, line.layout)] = (line.done, line.total)
            else:
                self.results.append(line)
                self._busy.pop((line.variant, self._key(line)), None)
            if self._progress is not None:
                busy = ", ".join(
                    f"{v}:{what} {d}/{t}"
                    for (v, what), (d, t) in sorted(self._busy.items())
                )
                now, fraction = self._clock(), self.fraction()
                if self._first is None:
                    self._first = (now, fraction)
                start, since = self._first
                pace = eta_text(now - start, fraction, since)
                done = f"{len(self.results)}/{self._total} done"
                self._progress(f"[{done}, {pace}] {busy}")


def start(
    module: str,
    args: Sequence[str],
    path: Sequence[Path] = (),
    env: Mapping[str, str] | None = None,
    stdin: int | None = None,
) -> subprocess.Popen[str]:
    """``python -m module args`` on CPU vLLM, quiet, one thread per process
    (two processes on two cores otherwise spin), ``path`` first on
    ``PYTHONPATH``, then this checkout; ``stdin``: as ``Popen``'s. ``-P``:
    the working directory does not go first on ``sys.path``, where another
    checkout's ``vllm_overlay`` would shadow this one."""
    full = dict(
        cpuplatform.cpu_environ(),
        VLLM_LOGGING_LEVEL="ERROR",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        **(env or {}),
    )
    full["PYTHONPATH"] = os.pathsep.join(
        [*map(str, path), str(REPO_ROOT), full.get("PYTHONPATH", "")]
    )
    return subprocess.Popen(
        [*warm.python_command(full), "-P", "-m", module, *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full,
    )


def read(
    proc: subprocess.Popen[str],
    mark: str,
    decoder: msgspec.json.Decoder[Any],
    sink: Callable[[Any], None],
    tail: list[str],
) -> None:
    """Decode the marked lines into ``sink``; keep the others' last lines."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(mark):
            sink(decoder.decode(line[len(mark) :]))
        else:
            tail.append(line)
            del tail[:-30]


def collect(
    started: Sequence[Started],
    mark: str,
    decoder: msgspec.json.Decoder[Any],
    sink: Callable[[Any], None],
) -> None:
    """Read every (process, label) to its end, one thread each; a process
    that exits non-zero raises with its label and last lines. Processes
    still running when this fails (or is interrupted) are stopped."""
    running = []
    try:
        for proc, label in started:
            tail: list[str] = []
            thread = threading.Thread(
                target=read, args=(proc, mark, decoder, sink, tail), daemon=True
            )
            thread.start()
            running.append((proc, thread, tail, label))
        for proc, thread, _, _ in running:
            proc.wait()
            thread.join()
    finally:
        stop([proc for proc, _ in started])
    for proc, _, tail, label in running:
        if proc.returncode != 0:
            raise RuntimeError(f"{label} exited {proc.returncode}:\n" + "".join(tail))


def stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    """SIGTERM the processes still running, so each stops its own children
    and cleans up after them; SIGKILL those still running after
    ``STOP_GRACE`` seconds."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + STOP_GRACE
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Emitter:
    """The child side: one struct per stdout line after ``mark``."""

    def __init__(self, mark: str) -> None:
        self.mark = mark
        self._encoder = msgspec.json.Encoder()

    def __call__(self, line: msgspec.Struct) -> None:
        sys.stdout.write(self.mark + self._encoder.encode(line).decode() + "\n")
        sys.stdout.flush()


def build_args(dirs: Mapping[str, Path]) -> list[str]:
    """``--build=NAME=DIR`` for each build's moriio directory."""
    return [f"--build={name}={directory}" for name, directory in dirs.items()]


def variant_args(dirs: Mapping[str, Path], variant: str, plan: Any) -> list[str]:
    """The arguments ``variant_parser`` reads."""
    return [
        *build_args(dirs),
        f"--variant={variant}",
        "--plan=" + msgspec.json.encode(plan).decode(),
    ]


def _build_arg(text: str) -> tuple[str, Path]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"{text!r}: want NAME=DIR")
    return name, Path(directory)


def variant_parser() -> argparse.ArgumentParser:
    """The child's command line: each build's moriio directory
    (``--build NAME=DIR``), its pair's name (``--variant``: ``base``,
    ``base->overlay``; ``builds.BuildPair.parse``) and its plan (JSON)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=_build_arg, action="append", required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--plan", required=True, help="JSON list of plan items")
    return ap


def load_variant(args: argparse.Namespace) -> BuildPair:
    """In the child: load its pair's builds (``builds.load_pair``) from
    ``variant_parser``'s arguments."""
    pair = BuildPair.parse(args.variant)
    load_core_from_env()
    load_pair(pair, dict(args.build))
    return pair


def pair_dirs(variant: str, dirs: Mapping[str, Path]) -> dict[str, Path]:
    """The directories of the builds pair ``variant`` runs."""
    pair = BuildPair.parse(variant)
    return {b: dirs[b] for b in dict.fromkeys((pair.prefill, pair.decode))}


def run_processes(
    sources: Mapping[str, tuple[dict[str, str] | None, str]],
    start: Callable[[str, dict[str, Path]], list[Started]],
    mark: str,
    decoder: msgspec.json.Decoder[Any],
    tally: Tally,
    variants: Sequence[str] | None = None,
) -> None:
    """Write each build's moriio directory (files None: the installed
    package), start each pair's processes with ``start(variant, dirs)``
    (``dirs``: its builds' directories; ``variants`` default: one pair per
    build) and read them all into ``tally``; the directories go
    afterwards."""
    with variant_dirs(sources) as dirs:
        started = []
        for variant in variants if variants is not None else list(dirs):
            started += start(variant, pair_dirs(variant, dirs))
        collect(started, mark, decoder, tally)


@contextlib.contextmanager
def variant_dirs(
    sources: Mapping[str, tuple[dict[str, str] | None, str]],
) -> Iterator[dict[str, Path]]:
    """Each variant's moriio directory (files None: the installed package),
    in a temporary directory removed on exit."""
    root = Path(tempfile.mkdtemp(prefix="vllm-overlay-sim-"))
    try:
        yield {
            variant: build_variant_dir(root / variant / "moriio", files)
            for variant, (files, _) in sources.items()
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_variant_process(
    variant: str,
    files: dict[str, str] | None,
    start: Callable[[dict[str, Path]], subprocess.Popen[str]],
    mark: str,
    decoder: msgspec.json.Decoder[Any],
) -> list[Any]:
    """One process of one build (``variant``) on its moriio directory,
    started by ``start(dirs)``; its results."""
    tally = Tally(1, lambda r: "", None)
    run_processes(
        {variant: (files, "")},
        lambda v, d: [(start(d), f"simulator process ({v})")],
        mark,
        decoder,
        tally,
    )
    return tally.results
