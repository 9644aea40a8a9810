"""The gate's phases and their seconds, for `nox -s bench -- suite`.

Standard library only: `nox -s lint` records its phase and `vllm-overlay
gate` (`nox -s unit-base`) each of its own (overlay, base, levels,
revert-red, removable, export, bytes) in ``.nox-reports/gate-phases.json``, one `nox`
run's phases only;
benchmarks/suite.py reads it back (validated).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PHASES_FILE = "gate-phases.json"


def record(path: Path, name: str, seconds: float, run: str = "") -> None:
    """Set phase ``name``'s seconds in ``path``: the others kept when they
    are of the same ``run`` (one `nox` invocation), dropped otherwise, so
    the file never mixes two runs' phases."""
    try:
        data = json.loads(path.read_text())
        phases = data["phases"] if isinstance(data.get("phases"), dict) else {}
        if data.get("run", "") != run:
            phases = {}
    except (OSError, ValueError, AttributeError):
        phases = {}
    phases[name] = round(seconds, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run, "phases": phases}, indent=2) + "\n")


@contextmanager
def timed(path: Path, name: str, run: str = "") -> Iterator[None]:
    """Record the seconds of the block as phase ``name`` of ``run``, even
    if it fails."""
    started = time.monotonic()
    try:
        yield
    finally:
        record(path, name, time.monotonic() - started, run)
