"""Patch 0002: trim every transfer group to the prompt's blocks before the
sliding-window clip, at both exchange points (non-hybrid READ).

Each leg's table is shaped as vLLM's KV cache manager leaves it: the
prompt's blocks plus the blocks of the lookahead slots that leg reserves,
with a window group's blocks below the window of the leg's next token freed.
P's ``request_finished_all_groups`` builds ``remote_block_ids``; D's
``update_state_after_alloc`` pairs them with its own table; D's
``build_connector_meta`` hands the pairs to the workers. Every pair of live
blocks must hold the same positions on both legs, and every decoder block
holding a position the last prompt token needs must be read. A pair with
the null block (the window start the prefiller's scheduler freed) is judged
by the window-start tests.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.patches.builders import (
    SMALL,
    Layout,
    LegPair,
    assert_sweep_reads_every_needed_block,
    cdiv,
    pairing_errors,
    prefiller_tail_errors,
)


def assert_paired(pair: LegPair, n: int, prefill_tail: int, decode_tail: int) -> None:
    lists = pair.exchange(n, prefill_tail, decode_tail)
    errors = pairing_errors(pair.layout, n, lists, judge_null=False)
    assert not errors, f"N={n}: " + "; ".join(errors)


# Prompt lengths that end a block's last 8 slots, past the 3-block window clip.
_TAIL_LENGTHS = (57, 109, 256, 1001)


@pytest.mark.parametrize(
    ("prefill_tail", "decode_tail"),
    [(0, 0), (0, 8), (8, 0), (8, 8)],
    ids=["neither", "only_decoder", "only_prefiller", "both"],
)
def test_tail_combinations_pair_by_position(
    leg_pairs: Callable[[Layout], LegPair], prefill_tail: int, decode_tail: int
) -> None:
    pair = leg_pairs(SMALL)
    for n in _TAIL_LENGTHS:
        # Each tail really adds a block past the prompt's blocks.
        assert cdiv(n + 8, SMALL.block_size) == cdiv(n, SMALL.block_size) + 1
        assert_paired(pair, n, prefill_tail, decode_tail)


@pytest.mark.slow
@pytest.mark.parametrize("sweep_name", ["b64-w128", "b16-w32-d1to8"])
def test_sweep_reads_every_needed_block(
    leg_pairs: Callable[[Layout], LegPair], sweep_name: str
) -> None:
    """Block 64 with a 128-token window and 9 lookahead slots (the decoder's,
    both legs'); block 16 with a 32-token window, 1 to 8 on the decoder."""
    assert_sweep_reads_every_needed_block(leg_pairs, sweep_name)


@pytest.mark.parametrize("handoff", ["allocation", "scheduler"])
def test_full_attention_prefiller_tail(
    leg_pairs: Callable[[Layout], LegPair], handoff: str
) -> None:
    """Only the prefiller holds lookahead slots (8 past the prompt), in its
    table as allocated and as vLLM's scheduler clips it to the computed
    tokens."""
    layout = Layout(block_size=16, window=None)
    wrong = prefiller_tail_errors(leg_pairs(layout), handoff)
    assert not wrong, f"{len(wrong)} wrong: {wrong[:4]}"
