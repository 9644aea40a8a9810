"""The loopback ports a sweep's ranks listen on.

Standard library only: the sweep (``run.py``) cuts the range among its
zygotes without importing the driver.
"""

from __future__ import annotations

PORT_RANGE = (10000, 32000)
"""Where ``driver.free_port_block`` draws, below the ephemeral range (the
connector's own ``get_open_port`` draws there)."""


def port_ranges(count: int) -> list[tuple[int, int]]:
    """``PORT_RANGE`` cut into ``count`` disjoint ranges, one per zygote of a
    sweep: two zygotes starting ranks at once never pick the same ports."""
    lo, hi = PORT_RANGE
    width = (hi - lo) // count
    return [(lo + k * width, lo + (k + 1) * width) for k in range(count)]
