"""Patch 0003: hybrid READ (attention groups next to a KDA group) trims every
attention group to the prompt tokens the prefiller computed before the
sliding-window clip, on both legs.

A hybrid prefiller computes the prompt without its last token
(``on_new_request``); ``split_block_groups`` clips each attention group
through ``get_exchange_clipped_blocks``. Tables are shaped as vLLM's KV cache
manager leaves them; pairs with the null block are judged by the
window-start tests.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.patches.builders import (
    Case,
    Layout,
    LegPair,
    allocation,
    cdiv,
    prefill_id,
    sweep,
)


@pytest.mark.parametrize(
    ("window", "prefill_tail", "decode_tail"),
    [(128, 0, 9), (128, 9, 0), (None, 0, 9)],
    ids=["only_decoder", "only_prefiller", "full-only_decoder"],
)
def test_hybrid_read_one_sided_tail(
    leg_pairs: Callable[[Layout], LegPair],
    window: int | None,
    prefill_tail: int,
    decode_tail: int,
) -> None:
    """Full attention, a sliding-window group unless ``window`` is None, and a
    KDA group; one leg holds lookahead slots past the prompt."""
    layout = Layout(block_size=64, window=window, mamba=True)
    case = Case("hybrid", layout, prefill_tail, decode_tail)
    wrong = sweep(leg_pairs(layout), [case], range(1, 1025), judge_null=False)
    wrong = wrong["hybrid"]
    assert not wrong, f"{len(wrong)} wrong prompt lengths, first {wrong[:8]}"


def test_producer_payload_ends_at_the_prefilled_prompt(
    leg_pairs: Callable[[Layout], LegPair],
) -> None:
    """P's remote_block_ids hold the blocks of the N-1 prefilled tokens: the
    full-attention group up to them, the window group their last
    cdiv(W, B) + 1 blocks; the blocks of P's 9 lookahead slots are not
    sent."""
    layout = Layout(block_size=64, window=128, mamba=True)
    pair = leg_pairs(layout)
    checked = 0
    for n in range(2, 700):
        prefilled = n - 1
        table = allocation(layout, prefilled + 9, prefill_id)
        if len(table[0]) == cdiv(prefilled, 64):
            continue  # the lookahead slots fit in the last prompt block
        params = pair.prefill(n, table=table)
        full, window, _ = params["remote_block_ids"]
        prompt_blocks = cdiv(prefilled, 64)
        assert full == table[0][:prompt_blocks], f"N={n}"
        assert window == table[1][:prompt_blocks][-3:], f"N={n}"
        checked += 1
    assert checked > 50
