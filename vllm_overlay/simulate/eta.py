"""How long a sweep takes: an estimate from its plan before it starts, and
the time left while it runs: the pace since its first report (the processes'
imports before it are not work done), held.

The per-case figures are measured on this project's machine (2 shared
cores): the scheduler sweep's default plan, about 28,000 cases, took 4
CPU-minutes; the byte sweep's default plan, 6,384 cases (both variants),
took 20 minutes on 2 cores. A run of the same selection as an earlier one
is estimated from that run's wall time instead.
"""

from __future__ import annotations

SCHEDULER_CPU_PER_CASE = 4 * 60 / 28_000
BYTES_CPU_PER_CASE = 2 * 20 * 60 / 6_384
# Each process imports vLLM and torch before its first case.
PROCESS_START = 20.0
# Before this share of the work or this many seconds, the pace says little.
_MIN_FRACTION = 0.01
_MIN_ELAPSED = 5.0


def expected_seconds(
    cases: int, cpu_per_case: float, processes: int, cores: int
) -> float:
    """Wall seconds of ``cases``: their CPU time over the processes that run
    at once (at most one per core), after one process start."""
    parallel = max(1, min(processes, cores))
    return PROCESS_START + cases * cpu_per_case / parallel


def seconds_left(elapsed: float, fraction: float, since: float = 0.0) -> float | None:
    """Seconds to go when the work from ``since`` to ``fraction`` (shares of
    the whole) took ``elapsed``; None while too little is done to tell."""
    if fraction >= 1:
        return 0.0
    done = fraction - since
    if done < _MIN_FRACTION or elapsed < _MIN_ELAPSED:
        return None
    return elapsed * (1 - fraction) / done


def duration(seconds: float) -> str:
    """``45 s``, ``3 min``, ``1 h 05 min``: rounded to what matters."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    minutes = round(s / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def eta_text(elapsed: float, fraction: float, since: float = 0.0) -> str:
    """The progress line's ``N %, ETA ...`` part (``seconds_left``)."""
    left = seconds_left(elapsed, fraction, since)
    pace = "ETA estimating" if left is None else f"ETA {duration(left)}"
    return f"{min(100, int(fraction * 100))} %, {pace}"


def expected_line(what: str, plan: str, seconds: float, basis: str) -> str:
    """The line a sweep prints before it starts."""
    return f"{what}: {plan}; expected about {duration(seconds)} ({basis})"
