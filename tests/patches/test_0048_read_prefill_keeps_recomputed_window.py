"""A READ prefiller with a window group keeps the window of the token the
decoder recomputes.

The decoder recomputes the last prompt token, position N-1, whose window
reads positions [N-W, N-1). When the prefill of N tokens finishes, vLLM's
scheduler frees every window block below the window of token N (positions
below N-W+1) before the connector builds its payload: whenever N-W is the
last slot of its block, that block is the null block in the prefiller's
list and the decoder cannot READ it. The prefiller computes N-1 tokens when
the model has a window group, so its scheduler keeps that block.

The first tests run a real prefill scheduler and a real decode scheduler
(each with its KV cache manager and the MoRIIO connector); the sweep hands
the real connectors tables shaped the way vLLM 0.34.0's managers leave them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.patches.builders import (
    SWEEPS,
    SWEPT_TOKENS,
    WINDOW_LAYOUTS,
    Case,
    Layout,
    LegPair,
    Read,
    SchedulerPair,
    cdiv,
    full_and_window_groups,
    prompt,
    scheduler_pair_cache,
    sweep,
)

# ---------------------------------------------------------------------------
# Real prefill and decode schedulers
# ---------------------------------------------------------------------------


def read_errors(
    read: Read, block_size: int, windows: Sequence[int | None]
) -> list[str]:
    """Why a READ is wrong: a pair that is not positional or reads a null
    block, or a page the decoder needs that it neither caches nor READs."""
    n = read.num_prompt_tokens
    errors = []
    # No local destination at all: nothing is READ (the decoder only
    # releases the prefill's blocks).
    reads = any(read.local_block_ids)
    for g, window in enumerate(windows):
        p_table, d_table = read.prefill_tables[g], read.decode_tables[g]
        local = read.local_block_ids[g] if reads else []
        remote = read.remote_block_ids[g] if reads else []
        if len(local) != len(remote):
            errors.append(f"group {g}: {len(local)} <- {len(remote)} blocks")
        pairs = list(zip(local, remote, strict=False))
        for d_block, p_block in pairs:
            if 0 in (d_block, p_block):
                errors.append(f"group {g}: pair {d_block} <- {p_block} is null")
            elif d_table.index(d_block) != p_table.index(p_block):
                errors.append(
                    f"group {g}: decode page {d_table.index(d_block)} <- "
                    f"prefill page {p_table.index(p_block)}"
                )
        first = 0 if window is None else max(n - window, 0) // block_size
        needed = range(first, cdiv(n - 1, block_size))
        cached = read.decode_hit_tokens // block_size
        read_pages = {d_table.index(d) for d, _ in pairs if d in d_table}
        missing = [k for k in needed if k >= cached and k not in read_pages]
        if missing:
            errors.append(f"group {g}: needed pages {missing} not read")
    return errors


@pytest.fixture(scope="module")
def scheduler_pairs(llama_model_dir: Path) -> Callable[[int, int], SchedulerPair]:
    return scheduler_pair_cache(llama_model_dir, full_and_window_groups)


def _window_lengths(block_size: int, window: int, count: int) -> list[int]:
    """N-W at every offset in its block, for ``count`` blocks past the window."""
    return list(range(window + 1, window + 1 + count * block_size))


@pytest.mark.parametrize("hit", [0.0, 0.5, 0.9], ids=["no_hit", "hit50", "hit90"])
@pytest.mark.parametrize(("block_size", "window"), WINDOW_LAYOUTS)
def test_real_schedulers_read_the_whole_window(
    scheduler_pairs: Callable[[int, int], SchedulerPair],
    block_size: int,
    window: int,
    hit: float,
) -> None:
    """Every N-W offset within its block, past the first window: the decoder
    READs every page of the window it lacks from the same page of the prefill,
    and never a null block."""
    pair = scheduler_pairs(block_size, window)
    wrong = []
    hits = []
    for n in _window_lengths(block_size, window, 3):
        hit_tokens = int(n * hit) // block_size * block_size
        read = pair.read(prompt(100 * n + int(100 * hit), n), hit_tokens)
        hits.append(read.decode_hit_tokens)
        errors = read_errors(read, block_size, (None, window))
        if errors:
            wrong.append(f"N={n}: {errors[0]}")
    assert not wrong, f"{len(wrong)} wrong: {wrong[:4]}"
    assert (max(hits) > 0) == (hit > 0), f"decoder prefix hits: {hits}"


def test_prefill_keeps_the_window_of_the_recomputed_token(
    scheduler_pairs: Callable[[int, int], SchedulerPair],
) -> None:
    """N-W ends its block (N % 16 == 15 for W = 64): the prefill hands over
    the block holding N-W, not the null block."""
    pair = scheduler_pairs(16, 64)
    for n in (95, 111, 207):
        read = pair.read(prompt(n, n))
        assert read.prefill_tables[1][(n - 64) // 16] != 0


# ---------------------------------------------------------------------------
# Every prompt length, every lookahead tail, DCP, hybrid READ
# ---------------------------------------------------------------------------

GEMMA = Layout(block_size=16, window=512)
ODD = Layout(block_size=16, window=40)

WINDOW_SWEEPS: dict[str, tuple[Case, ...]] = {
    "gemma-b16-w512": (
        Case("gemma", GEMMA, 0, 0),
        Case("gemma-d9", GEMMA, 0, 9),
        Case("gemma-p9", GEMMA, 9, 0),
    ),
    "b16-w40": (
        Case("b16-w40", ODD, 0, 0),
        Case("b16-w40-p9d9", ODD, 9, 9),
    ),
    **{
        f"dcp{dcp}-b16-w40": (
            Case(f"dcp{dcp}-b16-w40-d9", Layout(16, 40, dcp), 0, 9),
            Case(f"dcp{dcp}-b16-w40-p9", Layout(16, 40, dcp), 9, 0),
        )
        for dcp in (2, 4)
    },
    "hybrid-b16-w40": (
        Case("hybrid-b16-w40", Layout(16, 40, mamba=True), 0, 0),
        Case("hybrid-b16-w40-p9d9", Layout(16, 40, mamba=True), 9, 9),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("sweep_name", list(WINDOW_SWEEPS))
def test_sweep_reads_the_window_start(
    leg_pairs: Callable[[Layout], LegPair], sweep_name: str
) -> None:
    cases = WINDOW_SWEEPS[sweep_name]
    wrong = sweep(leg_pairs(cases[0].layout), cases, range(1, SWEPT_TOKENS + 1))
    summary = {name: (len(ns), ns[:8]) for name, ns in wrong.items() if ns}
    assert not summary, f"wrong prompt lengths (count, first): {summary}"


@pytest.mark.slow
@pytest.mark.parametrize("sweep_name", list(SWEEPS))
def test_sweep_reads_every_needed_block(
    leg_pairs: Callable[[Layout], LegPair], sweep_name: str
) -> None:
    """The prompt-trim sweeps (DSv4-like window with a decode or prefill
    lookahead tail, a small window with tails of 1..8 slots, DCP 2 and 4)
    read every block the decoder needs once the prefiller keeps the window
    of the token the decoder recomputes."""
    cases = SWEEPS[sweep_name]
    wrong = sweep(leg_pairs(cases[0].layout), cases, range(1, SWEPT_TOKENS + 1))
    summary = {name: (len(ns), ns[:8]) for name, ns in wrong.items() if ns}
    assert not summary, f"wrong prompt lengths (count, first): {summary}"
