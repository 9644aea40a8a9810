"""A rolling upgrade's half: this build's READ prefiller with vLLM's pinned
MoRIIO as the decoder (it cannot change), both legs vLLM's real schedulers
(the simulator's mixed pair, gemma: window 512, block 16). At N = 1 mod 16
the base decoder's window READ lands on the pages of the same positions
(patch 0018's window lists laid out for the whole prompt)."""

from __future__ import annotations

import pytest

from tests.simulate.mixed import Job, MixedPairs

LENGTHS = (529, 545)


@pytest.fixture(scope="module")
def results(mixed_pairs: MixedPairs) -> dict[int, tuple[bool, str | None, bool]]:
    """Every length's (wrong, error, fallback), one scheduler pair running
    them in turn."""
    return mixed_pairs.run(Job("overlay->base", "gemma", "read", 2048, 47829, LENGTHS))


@pytest.mark.parametrize("n", LENGTHS)
def test_base_decoder_reads_the_right_window(
    results: dict[int, tuple[bool, str | None, bool]], n: int
) -> None:
    """vLLM's pinned MoRIIO as the decoder (it cannot change), this build as
    the prefiller, both legs vLLM's real schedulers (the simulator's mixed
    pair, gemma: window 512, block 16): at N = 1 mod 16 the base decoder's
    window READ lands on the pages of the same positions."""
    assert results[n] == (False, None, False)
