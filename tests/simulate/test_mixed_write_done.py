"""A rolling upgrade in WRITE, both legs vLLM's real schedulers (the
simulator's mixed pairs, deepseek-v4-pro-BLNHC: a 128-token window, block
64, which vLLM's pinned MoRIIO serves in WRITE). Each leg's build sends or
takes the write_done notify: a base decoder takes this build's (its new
key unknown to it), and where this build's writer refuses the pages
(write_failed) it recomputes the request; this build's decoder reports a
base prefiller's unstated write_done failed and recomputes the request."""

from __future__ import annotations

import pytest

from tests.simulate.mixed import Job, MixedPairs

LENGTHS = (191, 255, 600)
VARIANTS = {"overlay->base": 48100, "base->overlay": 48300}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixed_write_reads_no_wrong_kv_and_counts_failed_receives(
    mixed_pairs: MixedPairs, variant: str
) -> None:
    """No wrong KV and no crash either way. A base decoder recomputes where
    this build's writer refuses its null window start (N - 127 = 0 mod 64:
    191, 255) and takes the write elsewhere; this build's decoder
    recomputes every request a base prefiller wrote."""
    job = Job(
        variant, "deepseek-v4-pro-BLNHC", "write", 1024, VARIANTS[variant], LENGTHS
    )
    result = mixed_pairs.run(job)
    assert all(not wrong and error is None for wrong, error, _ in result.values())
    fallbacks = {n for n, (_, _, fallback) in result.items() if fallback}
    if variant == "overlay->base":
        assert fallbacks == {191, 255}
    else:
        assert fallbacks == set(LENGTHS)
