"""READ moves exactly the pages the decoder lacks, on vLLM's real schedulers
(the installed vLLM, overlaid in ``nox -s unit``).

Both legs run the simulator's ``Pair``: specs grouped by vLLM's planner,
content-checked pages, a decoder warm-up for the prefix hit. These fail on
the pinned base, which reads every prompt page without a state group (0012),
the whole window of a window group (0014) and the recurrent state on a full
local hit (0013); ``tests/patches`` proves each patch on the stack below it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_overlay.simulate.drive import Pair
from vllm_overlay.simulate.layouts import expand

_PORTS = {
    "llama": 49100,
    "llama/dcp4": 49300,
    "gemma": 49500,
    "kimi": 49900,
    "kimi/dcp2": 50100,
    "kimi/dcp4": 50300,
}


def _pair(name: str) -> Pair:
    return Pair(expand([name])[0], max_model_len=4160, port=_PORTS[name])


@pytest.fixture(scope="module", params=["llama", "llama/dcp4", "gemma"])
def stateless(request: pytest.FixtureRequest) -> Iterator[Pair]:
    yield _pair(request.param)


@pytest.mark.parametrize("hit", [0.0, 0.5, 0.897])
@pytest.mark.parametrize("n", [300, 1000, 4001])
def test_without_state_pages_read_are_pages_missing(
    stateless: Pair, n: int, hit: float
):
    result = stateless.run_case(n, hit)
    assert result.error is None and not result.wrong
    assert (hit == 0.0) == (result.local_hit_tokens == 0)
    assert (result.pages_read, result.bytes_read) == (
        result.min_pages,
        result.min_bytes,
    )


@pytest.fixture(scope="module", params=["kimi", "kimi/dcp2", "kimi/dcp4"])
def kimi(request: pytest.FixtureRequest) -> Iterator[Pair]:
    yield _pair(request.param)


def test_full_local_hit_reads_no_state(kimi: Pair):
    """N - 1 ends a block of every group: a warm-up of the whole prompt is a
    full local hit, and the scheduler loads nothing."""
    step = max(info.block_tokens for info in kimi.groups)
    for n in (step + 1, 4 * step + 1):
        result = kimi.run_case(n, 1.0)
        assert result.error is None and not result.wrong
        assert result.local_hit_tokens == n - 1
        assert result.pages_read == result.min_pages == 0


def test_one_token_prompt_reads_nothing(kimi: Pair):
    result = kimi.run_case(1, 0.0)
    assert result.error is None and not result.wrong
    assert result.pages_read == result.min_pages == 0


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_group_holding_no_state_moves_no_page(mode: str):
    """The engine core hands the workers' handshake metadata to the
    scheduler's connector before it schedules (``hand_over_worker_metadata``):
    with it the decoder knows the least ``tokens_per_state`` of Qwen4 exp's
    compressed-key group (16, 0054), whose layers hold no state at N = 2."""
    pair = Pair(expand(["qwen4-exp-mtp"])[0], max_model_len=4160, port=50700, mode=mode)
    result = pair.run_case(2, 0.0)
    assert result.error is None and not result.wrong
    assert (result.pages_read, result.bytes_read) == (
        result.min_pages,
        result.min_bytes,
    )


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_ring_whose_open_group_is_empty_moves_no_page(mode: str):
    """The workers' model registers Qwen4 exp's QSA ring layers
    (``QSARawKeyCache``, ``legs.build_ring_layers``), whose group size (16)
    they state to the decoder's scheduler (0057): at N - 1 = 16 the ring's
    open group is empty, and its page does not move."""
    pair = Pair(expand(["qwen4-exp-mtp"])[0], max_model_len=4160, port=50900, mode=mode)
    result = pair.run_case(17, 0.0)
    assert result.error is None and not result.wrong
    assert (result.pages_read, result.bytes_read) == (
        result.min_pages,
        result.min_bytes,
    )
