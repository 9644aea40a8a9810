"""On the base vLLM files the simulator finds the bugs the seeds describe.

The base moriio files come from the pinned wheel (or /tmp/venv), loaded in a
worker process of their own, so this holds whatever the test venv carries.
"""

from __future__ import annotations

import pytest

SEED_001_EXAMPLES = (251, 377, 384, 440, 447, 636, 832, 895)


@pytest.fixture(scope="module")
def base_reports(base_worker_reports):
    """Our plan's reports (``conftest.BASE_PLANS["seeds"]``), by layout."""
    return {r.layout: r for r in base_worker_reports["seeds"]}


def test_dsv4_wrong_lengths_include_upstream_examples(base_reports):
    report = base_reports["dsv4"]
    assert report.error_cases == 0
    assert set(SEED_001_EXAMPLES) <= set(report.wrong_lengths)


def test_dsv4_wrong_lengths_match_seed_001_mechanism(base_reports):
    """Seed 001: B=64, W=128, decode lookahead 9, prefill none: N with
    (N-1) % 64 >= 55 reads a window shifted by one block.

    One difference, explained: the shift needs the decoder's SW list to be
    clipped, i.e. more than blocks_per_sw = cdiv(128, 64) + 1 = 3 blocks
    including the 9 lookahead slots (N + 9 > 192). Below that both lists are
    kept whole and ``_align_read_blocks`` drops the decoder's extra tail, so
    N = 56..64 and 120..128 are right. (The prefiller also frees the block
    holding position N-W when it is that block's last slot, N % 64 == 63;
    those N already satisfy the predicate.)
    """
    report = base_reports["dsv4"]
    seed = {n for n in range(1, 1025) if (n - 1) % 64 >= 55}
    clipped = {n for n in seed if n + 9 > 3 * 64}
    assert set(report.wrong_lengths) == clipped
    assert seed - clipped == set(range(56, 65)) | set(range(120, 129))


def test_kimi_at_89_7_percent_hit_reads_far_more_than_the_minimum(base_reports):
    report = base_reports["kimi"]
    assert report.error_cases == 0 and report.wrong_cases == 0
    assert report.pages_read >= 3 * report.min_pages > 0


def test_glm_starts_and_reads_pages_it_holds(base_reports):
    """Seed 001's refusal ("exactly one transferable attention group") is
    gone since vLLM 0.34.0 merged #60867: the base starts GLM, reads the
    right KV, and still reads more than the pages the decoder lacks."""
    report = base_reports["glm"]
    assert report.refused_at_start is None
    assert report.error_cases == 0 and report.wrong_cases == 0
    assert report.pages_read > report.min_pages > 0


def test_gemma_loses_the_window_start_the_prefiller_freed(base_reports):
    """Not in the seeds; found by the simulator (fixed by patch 0008).

    Before ``request_finished`` the prefiller frees out-of-window blocks for
    its next token N (``Scheduler._connector_finished``): positions below
    N - W + 1. The decoder recomputes token N-1, whose window starts at N-W.
    When N-W is the last slot of its block (B=16, W=512: N % 16 == 15), that
    block is the null block in the prefiller's list and the decoder reads it.
    When N-W starts its block (N % 16 == 0), the clip of cdiv(W, B) + 1 blocks
    starts one block below the window, which both legs freed: the READ pairs
    the null block with the decoder's null block.
    """
    report = base_reports["gemma"]
    assert report.error_cases == 0
    expected = {n for n in range(512, 621) if (n - 512) % 16 in (15, 0) and n > 512}
    assert set(report.wrong_lengths) == expected
    assert report.null_reads >= len(expected)
