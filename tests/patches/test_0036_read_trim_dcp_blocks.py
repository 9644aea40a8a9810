"""Patch 0036: the prompt trim counts DCP-effective blocks: a DCP-sharded
spec's block holds block_size * DCP positions, so a prefiller's lookahead
tail, which vLLM's scheduler hands over under DCP, is trimmed.

Layouts shard the full-attention group over DCP ranks (a sliding-window
group stays replicated, as vLLM requires); the prefiller's table is handed
over as vLLM's scheduler clips it (the real
``KVCacheManager.get_block_ids_for_computed_tokens``); pairs with the null
block are judged by the window-start tests.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.patches.builders import (
    Case,
    Layout,
    LegPair,
    assert_sweep_reads_every_needed_block,
    cdiv,
    prefill_id,
    prefiller_tail_errors,
    sweep,
)


@pytest.mark.slow
@pytest.mark.parametrize("sweep_name", ["dcp2-b64-w128", "dcp4-b64-w128"])
def test_sweep_reads_every_needed_block(
    leg_pairs: Callable[[Layout], LegPair], sweep_name: str
) -> None:
    """Full attention sharded over 2 and 4 DCP ranks beside a 128-token
    window, block 64, 9 lookahead slots on either leg."""
    assert_sweep_reads_every_needed_block(leg_pairs, sweep_name, clip=True)


def test_full_attention_prefiller_tail(leg_pairs: Callable[[Layout], LegPair]) -> None:
    """DCP 2, only the prefiller holds lookahead slots (8 past the prompt)."""
    layout = Layout(block_size=16, window=None, dcp=2)
    wrong = prefiller_tail_errors(leg_pairs(layout), "scheduler")
    assert not wrong, f"{len(wrong)} wrong: {wrong[:4]}"


@pytest.mark.parametrize("dcp", [2, 4])
def test_prefiller_hands_over_the_prompt_blocks(
    leg_pairs: Callable[[Layout], LegPair], dcp: int
) -> None:
    """A prefiller holding 8 lookahead slots past the prompt hands over the
    prompt's blocks alone, the list every decoder pairs (whatever its build)."""
    layout = Layout(block_size=16, window=None, dcp=dcp)
    span = layout.spans[0]
    wrong: list[str] = []
    for n in range(1, 4 * span + 1):
        params = leg_pairs(layout).prefill(n, 8, clip=True)
        [sent] = params["remote_block_ids"]
        if sent != [prefill_id(0, k) for k in range(cdiv(n, span))]:
            wrong.append(f"N={n}: {len(sent)} blocks for {cdiv(n, span)}")
    assert not wrong, f"{len(wrong)} wrong: {wrong[:4]}"


@pytest.mark.parametrize(
    "window", [128, None], ids=["only_prefiller", "full-only_prefiller"]
)
def test_hybrid_read_one_sided_tail(
    leg_pairs: Callable[[Layout], LegPair], window: int | None
) -> None:
    """Hybrid READ under DCP 2 (full attention, a window group unless
    ``window`` is None, a KDA group); only the prefiller holds 9 lookahead
    slots past the prompt it computed."""
    layout = Layout(block_size=64, window=window, dcp=2, mamba=True)
    case = Case("hybrid", layout, 9, 0)
    wrong = sweep(
        leg_pairs(layout), [case], range(1, 1025), judge_null=False, clip=True
    )
    wrong = wrong["hybrid"]
    assert not wrong, f"{len(wrong)} wrong prompt lengths, first {wrong[:8]}"
