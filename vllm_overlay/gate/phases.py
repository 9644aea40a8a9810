"""The gate's phases, their seconds and their CPU seconds, for `nox -s bench
-- suite`.

Standard library only: `nox -s lint` records its phase and `vllm-overlay
gate` (`nox -s unit-base`) each of its own (overlay, base, levels,
revert-red, removable, export, bytes) in ``.nox-reports/gate-phases.json``, one `nox`
run's phases only;
benchmarks/suite.py reads it back (validated). A phase's CPU seconds are
those of the processes that ran it and of the descendants they waited for:
on two cores the gate cannot end sooner than half their sum.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PHASES_FILE = "gate-phases.json"


def record(
    path: Path, name: str, seconds: float, run: str = "", cpu: float | None = None
) -> None:
    """Set phase ``name``'s seconds (and CPU seconds, when measured) in
    ``path``: the others kept when they are of the same ``run`` (one `nox`
    invocation), dropped otherwise, so the file never mixes two runs'
    phases."""
    try:
        data = json.loads(path.read_text())
        if data.get("run", "") != run:
            data = {}
    except (OSError, ValueError, AttributeError):
        data = {}
    phases, cpus = (data.get(k) for k in ("phases", "cpu"))
    phases = phases if isinstance(phases, dict) else {}
    cpus = cpus if isinstance(cpus, dict) else {}
    phases[name] = round(seconds, 1)
    if cpu is not None:
        cpus[name] = round(cpu, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"run": run, "phases": phases, "cpu": cpus}, indent=2)
    path.write_text(text + "\n")


def cpu_seconds() -> float:
    """This process's CPU seconds and those of the children it waited for."""
    mine = resource.getrusage(resource.RUSAGE_SELF)
    theirs = resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + theirs.ru_utime + theirs.ru_stime


@contextmanager
def timed(path: Path, name: str, run: str = "") -> Iterator[None]:
    """Record the seconds of the block as phase ``name`` of ``run``, even
    if it fails, with the CPU seconds of this process and of the children it
    waited for meanwhile (nothing else of this process may run beside it)."""
    started, cpu = time.monotonic(), cpu_seconds()
    try:
        yield
    finally:
        record(path, name, time.monotonic() - started, run, cpu_seconds() - cpu)
