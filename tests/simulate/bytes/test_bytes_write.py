"""The byte-level simulator's WRITE cases (``bytes/driver.py``,
``bytes/rank.py``).

A state model's decoder at a full local hit (KDA, N - 1 a multiple of the
block size) counts no external token: its connector asks the prefiller to
free its blocks and the decoder computes the last token from what it holds.
No WRITE is promised, so the case is judged at the decoder's own forward; a
driver that waited for a WRITE reported "the decoder never received the
WRITE" after 30 s. The other length of the configuration is a real WRITE
(a partial hit), still judged once it is received.
"""

from __future__ import annotations

import pytest

from vllm_overlay.simulate.bytes.report import ConfigItem, ConfigReport
from vllm_overlay.simulate.bytes.run import ZygoteSession

# Seconds the decoder is stepped for a promised WRITE. On loopback a WRITE
# lands within a step or two; the dropped one is waited for this long.
WRITE_WAIT = 5.0


def _item(layout: str, lengths: str, fault: str | None = None) -> ConfigItem:
    return ConfigItem(layout, "write", 1, 1, "LBNHC", fault=fault, lengths=lengths)


# TP 1->1 at a full hit.
FULL_HIT = {
    "no-external": _item("kimi", "65,100"),
    "minimum": _item("llama", "2,56"),
}
# At no hit and a full hit, waiting WRITE_WAIT for a WRITE.
DROPPED = _item("kimi", "65", fault="drop-write")
# ZAYA's state has no slice between TP 1 and 2 (write_failed), at no hit
# only (the first length at the first hit).
FAILED = ConfigItem("zaya", "write", 1, 2, "LBNHC", lengths="129", hit_offset=0)


@pytest.fixture(scope="module")
def full_hit(byte_zygote: ZygoteSession) -> dict[ConfigItem, ConfigReport]:
    reports = byte_zygote.run(list(FULL_HIT.values()), "100", "100")
    return {r.item: r for r in reports}


@pytest.fixture(scope="module")
def no_and_full_hit(byte_zygote: ZygoteSession) -> dict[ConfigItem, ConfigReport]:
    reports = byte_zygote.run([DROPPED, FAILED], "65", "0,100", write_wait=WRITE_WAIT)
    return {r.item: r for r in reports}


def _started(report: ConfigReport) -> ConfigReport:
    assert report.refused_at_start is None, report.refused_at_start
    return report


def _right(report: ConfigReport, cases: int) -> ConfigReport:
    assert _started(report).cases == cases
    assert report.error_cases == 0, report.first_errors
    assert report.wrong_cases == 0, report.wrong_notes
    return report


def test_a_write_with_no_external_token_is_judged_at_the_decoders_forward(
    full_hit,
) -> None:
    report = _right(full_hit[FULL_HIT["no-external"]], 2)
    # 100 is written (65 moves nothing).
    assert report.moved_bytes > 0


def test_a_write_minimum_counts_every_page_past_the_decoders_local_hit(
    full_hit,
) -> None:
    """A WRITE request is not scheduled in the step that allocates it, so its
    local hit is its computed tokens less the external ones it waits for.
    Without it the minimum counted only pages holding wrong bytes: the fresh
    block after the hit, the warm-up's freed partial block holding the same
    bytes, was left out although the prefiller has to write it (llama at a
    full hit, lengths 2 and 56: one page each moved, a minimum of 0)."""
    report = _right(full_hit[FULL_HIT["minimum"]], 2)
    assert report.moved_bytes == report.min_bytes > 0


def test_a_write_promised_and_never_received_is_still_an_error(
    no_and_full_hit,
) -> None:
    """With the prefiller's WRITE dropped, the same KDA length at no hit
    (a WRITE promised) is a case error, while at a full hit (no WRITE
    promised) the decoder is judged on what it holds."""
    report = _started(no_and_full_hit[DROPPED])
    assert report.cases == 2
    assert report.error_cases == 1
    assert report.first_errors == ["the decoder never received the WRITE"]
    assert report.wrong_cases == 0, report.wrong_notes
    assert report.moved_bytes == 0


def test_a_write_the_prefiller_fails_is_recomputed_not_judged(
    no_and_full_hit,
) -> None:
    """A WRITE the prefiller fails (ZAYA's state has no slice between TP 1
    and 2: write_failed) reaches the decoder as a failed receive, and its
    scheduler recomputes the request: a fallback case, no byte judged.
    Judged as a received WRITE, its pages read as wrong bytes."""
    report = _started(no_and_full_hit[FAILED])
    assert report.cases == 1
    assert report.error_cases == 0, report.first_errors
    assert report.wrong_cases == 0, report.wrong_notes
    assert report.fallback_cases == 1
    assert report.moved_bytes == report.min_bytes == 0


def test_a_recomputed_write_leaves_no_stray_bytes_for_the_next_case(
    byte_zygote: ZygoteSession,
) -> None:
    """LFM3 at TP 1->2: the prefiller fails every WRITE (its ShortConv state
    has no slice) and the decoder recomputes each request. The request after
    two recomputed ones, at a full local hit (no WRITE: judged at the
    decoder's forward), holds every byte right, and no byte changed outside
    its pages: the recomputed requests' zeroed blocks are the decoder's own
    writes. Judged as stray, the third case read 45056 stray bytes a rank."""
    item = ConfigItem("lfm3", "write", 1, 2, "LBNHC", lengths="2,17,65", hit_offset=0)
    [report] = byte_zygote.run([item], "2,17,65", "0,50,100")
    assert report.refused_at_start is None, report.refused_at_start
    assert report.cases == 3
    assert report.error_cases == 0, report.first_errors
    assert report.fallback_cases == 2
    assert report.wrong_cases == report.stray_cases == 0, report.wrong_notes
