"""Cases that follow from small ones give what the cases run whole give.

``shrink.py`` runs a case a whole number of periods longer than a small one
as that small one and two steps, and extrapolates its counts. These tests
hold it to the reference, every case through the real schedulers
(``--whole``): per case on the installed moriio files, and per layout
report on the pinned base, whose wrong lengths the extrapolation must keep.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_overlay.simulate import shrink
from vllm_overlay.simulate.check import FULL, WINDOW, CaseResult, GroupInfo

HITS = [0.0, 0.5, 0.897, 1.0]


# -- the arithmetic ----------------------------------------------------------


def _period(window: int = 512, block: int = 16, lookahead: int = 0) -> shrink.Period:
    groups = [GroupInfo(WINDOW, block, window, 1), GroupInfo(FULL, block, 0, 1)]
    return shrink.period_of(groups, [block], lookahead)


def test_period_is_every_size_and_cuts_are_the_reaches():
    period = _period(window=128, block=64, lookahead=9)
    assert period.period == 64
    assert period.cuts == (0, 128)
    assert period.margin == 64 + 9 + 1


@given(
    n=st.integers(1, 4096),
    hit=st.sampled_from(HITS),
    window=st.sampled_from([16, 40, 128, 512]),
    block=st.sampled_from([16, 64]),
    lookahead=st.sampled_from([0, 1, 9]),
)
def test_small_cases_are_congruent_and_keep_away_from_every_cut(
    n, hit, window, block, lookahead
):
    period = _period(window, block, lookahead)
    p = period.period
    s, g = shrink.case_key(n, hit)
    ways = shrink._ways(period, (s, g))
    s0, g0 = ways.base
    assert (s0 + ways.held_periods * p, g0 + ways.lack_periods * p) == (s, g)
    assert ways.held_periods >= 0 and ways.lack_periods >= 0
    if ways.held_periods:
        assert ways.held_step == (s0 + p, g0)
    if ways.lack_periods:
        assert ways.lack_step == (s0, g0 + p)
    # Every quantity moved stays in its own stretch, as does the sum.
    for x0, k, x in ((s0, ways.held_periods, s), (g0, ways.lack_periods, g)):
        if k:
            assert period.zone(x0) == period.zone(x0 + p) == period.zone(x)
    if ways.held_periods or ways.lack_periods:
        zone = period.zone(n)
        assert zone is not None and period.zone(s0 + g0) == zone


def test_a_quantity_near_a_cut_is_kept():
    period = _period(window=512, block=16)
    assert shrink._ways(period, (0, 512)).base == (0, 512)
    # The lacked part is near the window: only the held part moves.
    ways = shrink._ways(period, (1000, 500))
    assert ways.base[1] == 500 and ways.lack_step is None
    assert ways.base[0] < 1000 and ways.held_periods > 0
    assert shrink._ways(period, (0, 2000)).base[1] < 2000


def _result(n, **kw):
    fields = dict(
        n=n,
        hit_fraction=0.0,
        local_hit_tokens=0,
        wrong=False,
        wrong_groups=[],
        pages_read=n // 16,
        min_pages=n // 16,
        bytes_read=n,
        min_bytes=n,
        extra_reads=0,
        duplicate_reads=0,
        unread=0,
    )
    fields.update(kw)
    return CaseResult(**fields)


def _fake_run(wrong_at=frozenset()):
    """A linear layout: pages n // 16, wrong where ``wrong_at`` holds."""
    calls = []

    def run(n, held, hit):
        calls.append((n, held))
        bad = n in wrong_at
        return _result(
            n,
            hit_fraction=hit,
            local_hit_tokens=held // 16 * 16,
            wrong=bad,
            wrong_groups=[0] if bad else [],
        )

    return run, calls


def test_counts_extrapolate_and_a_disagreement_runs_the_case_whole():
    period = _period(window=40, block=16)
    run, calls = _fake_run()
    lengths = list(range(1, 2049))
    stats = shrink.Stats()
    got = list(shrink.sweep(period, lengths, HITS, run, stats))
    small = set(calls)
    want = [run(n, shrink.case_key(n, h)[0], h) for h in HITS for n in lengths]
    assert [msgspec.to_builtins(r) for r in got] == [
        msgspec.to_builtins(r) for r in want
    ]
    assert stats.whole == 0 and len(small) < len(lengths) * len(HITS) // 3
    assert stats.shrunk > len(lengths)
    # The step is wrong where the small case is right: the long case runs
    # whole (and is right here).
    ways = shrink._ways(period, (0, 2000))
    run, calls = _fake_run(wrong_at={ways.lack_step[1]})
    stats = shrink.Stats()
    got = list(shrink.sweep(period, [2000], [0.0], run, stats))
    assert not got[0].wrong and stats.whole == 1 and calls[-1] == (2000, 0)


# -- against the real schedulers --------------------------------------------

# Every 97th length, the cuts' neighbourhoods and the long end.
SAMPLE = sorted({*range(1, 4097, 97), 127, 128, 129, 191, 192, 511, 512, 513, 4096})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gemma", "dsv4", "glm", "kimi/dcp2"])
def test_every_case_equals_the_case_run_whole(name):
    _shrunk_equals_whole(name, "read")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gemma", "kimi/dcp2"])
def test_every_write_case_equals_the_case_run_whole(name):
    """WRITE's pairing is the same arithmetic on positions: its cases shrink
    by the same periods."""
    _shrunk_equals_whole(name, "write")


def _shrunk_equals_whole(name: str, mode: str) -> None:
    from vllm_overlay.simulate.drive import Pair
    from vllm_overlay.simulate.layouts import expand

    layout = expand([name])[0]
    small = Pair(layout, 4096 + 64, port=47600, mode=mode)
    whole = Pair(layout, 4096 + 64, port=47800, mode=mode)
    period = shrink.layout_period(small)
    stats = shrink.Stats()

    def run(n, held, hit):
        stats.run += 1
        return small.run_case(n, hit, held=held)

    got = list(shrink.sweep(period, SAMPLE, HITS, run, stats))
    want = [whole.run_case(n, hit) for hit in HITS for n in SAMPLE]
    assert got == want
    assert stats.shrunk > len(HITS) * 10 and stats.whole == 0
    assert any(r.n > 1000 for r in got)


@pytest.fixture(scope="module")
def base_both_ways(base_worker_reports):
    """The pinned base's reports, shrunk and whole, in one worker
    (``conftest.BASE_PLANS["shrink"]``)."""
    return base_worker_reports["shrink"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dsv4", "gemma"])
def test_base_reports_equal_the_reports_run_whole(base_both_ways, name):
    shrunk, whole = (r for r in base_both_ways if r.layout == name)
    assert whole.period == 0 and shrunk.period > 0
    assert shrunk.wrong_cases > 0, "the base reads wrong KV here"

    def same(r):
        out = msgspec.to_builtins(r)
        for key in ("seconds", "cases_run", "period", "run_cost"):
            out.pop(key)
        return out

    assert same(shrunk) == same(whole)


def test_calibrate_measures_the_fixed_cost_in_tokens_worth():
    clock = [0.0]

    def run_case(n, fixed=3e-3, per_token=2e-6, error=None):
        clock[0] += fixed + per_token * n
        return _result(n, error=error)

    got = shrink.calibrate(run_case, 4096, clock=lambda: clock[0])
    assert got == 1500  # 3 ms over 2 us a token
    # Too short a sweep to measure, or a case that fails: the default.
    assert shrink.calibrate(run_case, 40, clock=lambda: clock[0]) == shrink.RUN_COST

    def failing(n):
        return run_case(n, error="MoRIIOError: refused")

    assert shrink.calibrate(failing, 4096, clock=lambda: clock[0]) == shrink.RUN_COST
    # A fixed cost is never taken as less than 64 or more than 65536 tokens.
    cheap = shrink.calibrate(
        lambda n: run_case(n, fixed=1e-9), 4096, clock=lambda: clock[0]
    )
    assert cheap == 64


def test_a_larger_fixed_cost_runs_unshared_cases_whole():
    # At the 89.7 % hit nobody shares a case's small ones: with a fixed cost
    # high enough, running the case whole is cheaper, and the results agree.
    period = _period(window=40, block=16)
    lengths = list(range(1500, 2049))
    runs = {}
    for cost in (shrink.RUN_COST, 20000):
        run, calls = _fake_run()
        stats = shrink.Stats()
        got = list(shrink.sweep(period, lengths, [0.897], run, stats, cost))
        want = [run(n, shrink.case_key(n, 0.897)[0], 0.897) for n in lengths]
        assert [msgspec.to_builtins(r) for r in got] == [
            msgspec.to_builtins(r) for r in want
        ]
        runs[cost] = stats.shrunk
    assert runs[20000] < runs[shrink.RUN_COST]


def test_a_sweep_too_sparse_to_shrink_is_not_measured():
    period = _period(window=40, block=16)
    assert shrink.may_shrink(period, list(range(1, 2049)), HITS)
    # Prompts within the margin of 0 have no small ones at all.
    assert not shrink.may_shrink(period, [1, 5, 10, 16], HITS)
