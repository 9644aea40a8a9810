"""Every prompt length from a few: cases that differ by whole periods.

A case is a prompt of ``n`` tokens whose first ``s`` the decoder already
holds (``s = round(n * hit)``); the other ``g = n - s`` (the gap) come from
the prefiller. What the schedulers and the connector do with it is
arithmetic on positions: block indices and offsets, window starts, chunk
and compression-group boundaries, ring slots, lookahead slots. All of it
repeats when ``s``, ``g`` or ``n`` grows by the layout's *period* ``P`` (the
least common multiple of every block, chunk, compression-group and ring
size of both legs), as long as none of them crosses a *cut*: 0, or a reach
(window, chunk, ring) give or take ``P`` plus the lookahead, where a window
starts to reach the other side or past the prompt's start.

So a case ``(s, g)`` with ``s = s0 + a*P`` and ``g = g0 + b*P``, each part and
their sum staying clear of every cut, runs as small ones: ``(s0, g0)``, and
``(s0 + P, g0)`` when ``a > 0``, ``(s0, g0 + P)`` when ``b > 0``. Its verdict
(wrong or not, which groups, the error) must be the same in all three, and
its counts (local hit, pages and bytes read, the minimum, extra, duplicate
and unread pages) are extrapolated as ``c0 + a*(cS - c0) + b*(cG - c0)``.
Where the three disagree, the case runs whole; so does a case its small
ones would not make cheaper (sparse lengths).

This rests on the behaviour being periodic past the cuts: a bug that shows
only at some long length and at none congruent to it below would be missed.
``tests/simulate/test_shrink.py`` holds the result to the cases run whole
(``--whole``) on the real schedulers, base and overlay.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from vllm_overlay.simulate.check import CHUNK, FULL, RING, WINDOW, CaseResult, GroupInfo

if TYPE_CHECKING:
    from vllm_overlay.simulate.drive import Pair

Key = tuple[int, int]
"""(tokens the decoder holds, tokens it lacks)."""


class Period(NamedTuple):
    """A layout's period and the positions near which it does not hold."""

    period: int
    cuts: tuple[int, ...]
    """0 and the reaches (windows, chunks, rings): a quantity within
    ``margin`` of one is never moved by whole periods."""
    margin: int

    def zone(self, x: int) -> tuple[int, int] | None:
        """The stretch ``[lo, hi)`` around ``x`` free of cuts (at least two
        periods wide), or None when ``x`` lies near a cut."""
        lo, hi = 0, math.inf
        for c in self.cuts:
            if c - self.margin <= x < c + self.margin:
                return None
            if c + self.margin <= x:
                lo = max(lo, c + self.margin)
            else:
                hi = min(hi, c - self.margin)
        if hi - lo < 2 * self.period:
            return None
        return lo, int(min(hi, 1 << 62))


def period_of(
    groups: Sequence[GroupInfo], block_tokens: Iterable[int], lookahead: int = 0
) -> Period:
    """The layout's period and cuts (see the module docstring)."""
    sizes = [*block_tokens]
    # Near 0 the first pages are partial and the last position is the
    # decoder's own: 0 is a cut too.
    cuts = {0}
    for info in groups:
        sizes.append(info.block_tokens)
        if info.kind == FULL:
            sizes.append(info.tokens_per_state)
        elif info.kind in (CHUNK, RING):
            sizes.append(info.window)
            cuts.add(info.window)
        if info.kind == RING:
            sizes.append(info.ring_capacity)
            cuts.add(info.ring_capacity)
        elif info.kind == WINDOW:
            cuts.add(info.window)
    period = math.lcm(*(s for s in sizes if s > 0))
    return Period(period, tuple(sorted(cuts)), period + lookahead + 1)


def case_key(n: int, hit: float) -> Key:
    s = round(n * hit)
    return s, n - s


class _Ways(NamedTuple):
    base: Key
    held_step: Key | None
    """(s0 + P, g0) when the held part has whole periods above it."""
    lack_step: Key | None
    held_periods: int
    lack_periods: int


def _lowest(x: int, floor: int, p: int) -> int:
    """The least value >= ``floor`` congruent to ``x`` modulo ``p``."""
    return floor + (x - floor) % p


def _ways(period: Period, key: Key) -> _Ways:
    """The small cases of ``key``: the held part, the lacked part and
    their sum each stay in their own stretch free of cuts."""
    s, g = key
    p = period.period
    zs, zg, zn = period.zone(s), period.zone(g), period.zone(s + g)
    if zn is None or (zs is None and zg is None):
        return _Ways(key, None, None, 0, 0)
    s0 = s if zs is None else _lowest(s, zs[0], p)
    g0 = g if zg is None else _lowest(g, zg[0], p)
    # The sum must stay in its own stretch: give back periods to one part.
    if s0 + g0 < zn[0]:
        short = -(-(zn[0] - s0 - g0) // p) * p
        if zg is not None and g0 + short <= g:
            g0 += short
        elif zs is not None and s0 + short <= s:
            s0 += short
        else:
            return _Ways(key, None, None, 0, 0)
    a, b = (s - s0) // p, (g - g0) // p
    # A step must not leave its stretch either.
    if a and (zs is None or s0 + p >= zs[1]):
        return _Ways(key, None, None, 0, 0)
    if b and (zg is None or g0 + p >= zg[1]):
        return _Ways(key, None, None, 0, 0)
    return _Ways(
        (s0, g0),
        (s0 + p, g0) if a else None,
        (s0, g0 + p) if b else None,
        a,
        b,
    )


_COUNTS = (
    "local_hit_tokens",
    "pages_read",
    "min_pages",
    "bytes_read",
    "min_bytes",
    "extra_reads",
    "duplicate_reads",
    "unread",
    "null_reads",
)


def _verdict(r: CaseResult) -> tuple[object, ...]:
    return (r.wrong, tuple(r.wrong_groups), r.error)


def extrapolate(
    ways: _Ways,
    n: int,
    hit: float,
    base: CaseResult,
    held: CaseResult | None,
    lack: CaseResult | None,
) -> CaseResult | None:
    """The case's result from its small ones; None when they disagree."""
    steps = [
        (r, k) for r, k in ((held, ways.held_periods), (lack, ways.lack_periods)) if r
    ]
    if any(_verdict(r) != _verdict(base) for r, _ in steps):
        return None
    counts = {}
    for name in _COUNTS:
        c0 = getattr(base, name)
        counts[name] = c0 + sum(k * (getattr(r, name) - c0) for r, k in steps)
    return msgspec.structs.replace(base, n=n, hit_fraction=hit, **counts)


class Stats(msgspec.Struct):
    cases: int = 0
    run: int = 0
    """Cases run through the schedulers (the caller's ``run`` counts)."""
    shrunk: int = 0
    """Cases extrapolated from their small ones."""
    whole: int = 0
    """Cases run whole because their small ones disagreed."""


def layout_period(pair: Pair) -> Period:
    """The period of a prefill/decode pair's layout, both legs' blocks."""
    layout = pair.layout
    lookahead = max(
        layout.prefill_slots.num_speculative_tokens,
        layout.prefill_slots.num_lookahead_tokens,
        layout.decode_slots.num_speculative_tokens,
        layout.decode_slots.num_lookahead_tokens,
        layout.speculative.num_speculative_tokens if layout.speculative else 0,
    )
    blocks = [*pair.p.group_block_tokens, *pair.d.group_block_tokens]
    return period_of(pair.groups, blocks, lookahead)


RUN_COST = 256
"""A case's fixed cost, in prompt tokens' worth of scheduler work, when it
is not measured (``calibrate``). It only decides whether a case runs whole
or from its small ones, never a result."""


COST_BOUNDS = (64, 1 << 16)
"""The least and the most fixed cost ``calibrate`` returns."""


def calibrate(
    run_case: Callable[[int], CaseResult],
    longest: int,
    probes: int = 5,
    clock: Callable[[], float] = time.process_time,
) -> int:
    """A case's fixed cost on this pair, in prompt tokens' worth: the CPU
    time of a 2-token case, less its 2 tokens, over the CPU time per token
    between it and a longer one (up to 1026 tokens, within ``longest``).
    Measured, since it differs by layout: about 470 tokens' worth on llama,
    1600 on dsv4 and 6000 on kimi, whose small cases nobody shares at the
    89.7 % hit are cheaper run whole there. ``run_case(n)`` runs one case
    of ``n`` tokens; a probe that fails leaves ``RUN_COST``.
    """
    long = min(1026, longest)
    if long < 66:
        return RUN_COST

    def cpu(n: int) -> float | None:
        # The first run warms up (first-use costs are not the case's).
        if run_case(n).error is not None:
            return None
        times = []
        for _ in range(probes):
            start = clock()
            run_case(n)
            times.append(clock() - start)
        return statistics.median(times)

    short, full = cpu(2), cpu(long)
    if short is None or full is None or full <= short:
        return RUN_COST
    per_token = (full - short) / (long - 2)
    low, high = COST_BOUNDS
    return max(low, min(high, round(short / per_token) - 2))


def _cost(key: Key, run_cost: int) -> int:
    return key[0] + key[1] + run_cost


def _steps(ways: _Ways) -> list[Key]:
    return [k for k in (ways.base, ways.held_step, ways.lack_step) if k is not None]


def _plan(
    period: Period, lengths: Sequence[int], hits: Sequence[float]
) -> tuple[list[tuple[int, float, _Ways]], Counter[Key]]:
    """Every case's small ones, and how many cases each small one serves."""
    plan = [(n, hit, _ways(period, case_key(n, hit))) for hit in hits for n in lengths]
    return plan, Counter(k for *_, ways in plan for k in _steps(ways))


def _cheaper_small(ways: _Ways, key: Key, users: Counter[Key], run_cost: int) -> bool:
    """Do the case's shares of its small ones cost less than the case?"""
    share = sum(_cost(k, run_cost) / users[k] for k in _steps(ways))
    return share < _cost(key, run_cost)


def may_shrink(period: Period, lengths: Sequence[int], hits: Sequence[float]) -> bool:
    """Could any case follow from its small ones at a fixed cost within
    ``COST_BOUNDS``? Whether a case does is linear in that cost, so the
    bounds decide; where no case could (prompts near the cuts), measuring
    the cost (``calibrate``) is wasted."""
    plan, users = _plan(period, lengths, hits)
    return any(
        _cheaper_small(ways, case_key(n, hit), users, cost)
        for n, hit, ways in plan
        if ways.held_step or ways.lack_step
        for cost in COST_BOUNDS
    )


def sweep(
    period: Period | None,
    lengths: Sequence[int],
    hits: Sequence[float],
    run: Callable[[int, int, float], CaseResult],
    stats: Stats | None = None,
    run_cost: int = RUN_COST,
) -> Iterator[CaseResult]:
    """Every (hit, n) case, in the order of the one-at-a-time sweep.

    ``run(n, held, hit)`` runs one case whose decoder holds ``held``
    tokens; ``period`` None runs every case whole. ``run_cost``: a case's
    fixed cost in tokens' worth (``calibrate``).
    """
    stats = stats if stats is not None else Stats()
    done: dict[Key, CaseResult] = {}

    def result(key: Key, hit: float) -> CaseResult:
        if key not in done:
            done[key] = run(key[0] + key[1], key[0], hit)
        return done[key]

    if period is None:
        for hit in hits:
            for n in lengths:
                stats.cases += 1
                yield run(n, case_key(n, hit)[0], hit)
        return
    # A small case's cost is shared by every case it stands for; a case
    # whose share costs no less than itself (sparse lengths) runs whole.
    plan, users = _plan(period, lengths, hits)
    for n, hit, ways in plan:
        stats.cases += 1
        key = case_key(n, hit)
        if key in done or not _cheaper_small(ways, key, users, run_cost):
            yield msgspec.structs.replace(result(key, hit), n=n, hit_fraction=hit)
            continue
        base = result(ways.base, hit)
        held = result(ways.held_step, hit) if ways.held_step else None
        lack = result(ways.lack_step, hit) if ways.lack_step else None
        got = extrapolate(ways, n, hit, base, held, lack)
        if got is None:
            stats.whole += 1
            got = result(key, hit)
        else:
            stats.shrunk += 1
        yield msgspec.structs.replace(got, n=n, hit_fraction=hit)
