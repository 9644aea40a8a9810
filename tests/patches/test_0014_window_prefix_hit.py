"""Patch 0014: with a decoder prefix hit, READ reads only the sliding-window
pages the decoder lacks.

The decoder's window group holds the pages of its local hit that lie in the
window of the token it recomputes; without the patch READ pairs the whole
window. Both legs are real vLLM schedulers with the MoRIIO connector: a
decoder warm-up gives the prefix hit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.patches.builders import (
    WINDOW_LAYOUTS,
    SchedulerPair,
    full_and_window_groups,
    lacked_pages,
    pages_not_lacked,
    paired_pages,
    prompt,
    scheduler_pair_cache,
)


@pytest.fixture(scope="module")
def scheduler_pairs(llama_model_dir: Path) -> Callable[[int, int], SchedulerPair]:
    return scheduler_pair_cache(llama_model_dir, full_and_window_groups)


@pytest.mark.parametrize("hit", [0.5, 0.9], ids=["hit50", "hit90"])
@pytest.mark.parametrize(("block_size", "window"), WINDOW_LAYOUTS)
def test_window_pages_read_are_pages_lacked(
    scheduler_pairs: Callable[[int, int], SchedulerPair],
    block_size: int,
    window: int,
    hit: float,
) -> None:
    """Prompts from one window to three past it, N-W at every offset in its
    block: each group reads exactly the pages it lacks."""
    pair = scheduler_pairs(block_size, window)
    wrong = []
    for n in range(window + 1, window + 1 + 3 * block_size, 3):
        hit_tokens = int(n * hit) // block_size * block_size
        read = pair.read(prompt(100 * n + int(100 * hit), n), hit_tokens)
        assert read.decode_hit_tokens == hit_tokens
        # The full group attends to every position, the window group to
        # those of the window of N-1.
        wrong += pages_not_lacked(read, block_size, (0, max(n - window, 0)))
    assert not wrong, f"{len(wrong)} wrong: {wrong[:4]}"


def test_no_hit_reads_the_whole_window(
    scheduler_pairs: Callable[[int, int], SchedulerPair],
) -> None:
    pair = scheduler_pairs(16, 64)
    for n in (65, 100, 143):
        read = pair.read(prompt(7 * n, n), 0)
        assert paired_pages(read, 1) == lacked_pages(read, 16, n - 64)
        assert paired_pages(read, 1)[0] == (n - 64) // 16
