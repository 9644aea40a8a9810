"""On the pinned base, the byte-level simulation finds the wrong KV the
scheduler-level one finds (seed 001: DeepSeek-V4-like, block 64, window 128,
9 decode lookahead slots): the same prompt lengths, now as wrong bytes the
decoder attends to, read by the base's real workers."""

from __future__ import annotations

import pytest

from vllm_overlay.simulate.bytes.report import ConfigItem
from vllm_overlay.simulate.bytes.run import run_zygote
from vllm_overlay.simulate.plan import base_files

LENGTHS = range(230, 263)


@pytest.fixture(scope="module")
def dsv4_base():
    files, _ = base_files()
    item = ConfigItem("dsv4", "read", 1, 1, "LBNHC")
    lengths = f"{LENGTHS.start}-{LENGTHS.stop - 1}"
    (report,) = run_zygote("base", files, [item], lengths, "0")
    return report


def test_base_reads_wrong_bytes_exactly_where_seed_001_says(dsv4_base):
    # (N - 1) % 64 >= 55 with the decoder's window list clipped (N + 9 > 192):
    # the same set test_base_agrees_with_seeds.py checks at page level.
    expected = [n for n in LENGTHS if (n - 1) % 64 >= 55 and n + 9 > 3 * 64]
    assert dsv4_base.first_errors == []
    assert dsv4_base.cases == len(LENGTHS)
    assert dsv4_base.wrong_lengths == {"0": expected}
    assert dsv4_base.stray_cases == 0
