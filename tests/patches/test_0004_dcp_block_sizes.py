"""Patch 0004: per-group block sizes are DCP-effective: a DCP-sharded spec's
block holds block_size * DCP positions, so the prompt trim and the WRITE
prompt clamp count blocks by that span.

Layouts shard the full-attention group over DCP ranks (a sliding-window
group stays replicated, as vLLM requires); tables are shaped as vLLM's KV
cache manager leaves them; pairs with the null block are judged by the
window-start tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.patches.builders import (
    Case,
    Layout,
    LegPair,
    allocation,
    assert_sweep_reads_every_needed_block,
    cdiv,
    full_attention_spec,
    make_kv_cache_blocks,
    make_leg_connector,
    make_request,
    make_scheduler_output,
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
    assert_sweep_reads_every_needed_block(leg_pairs, sweep_name)


@pytest.mark.parametrize("handoff", ["allocation", "scheduler"])
def test_full_attention_prefiller_tail(
    leg_pairs: Callable[[Layout], LegPair], handoff: str
) -> None:
    """DCP 2, only the prefiller holds lookahead slots (8 past the prompt).
    vLLM's scheduler clips P's table to the computed tokens by the spec block
    size, which leaves the tail block in place under DCP."""
    layout = Layout(block_size=16, window=None, dcp=2)
    wrong = prefiller_tail_errors(leg_pairs(layout), handoff)
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
    wrong = sweep(leg_pairs(layout), [case], range(1, 1025), judge_null=False)
    wrong = wrong["hybrid"]
    assert not wrong, f"{len(wrong)} wrong prompt lengths, first {wrong[:8]}"


@pytest.mark.parametrize("dcp", [1, 2], ids=["dcp1", "dcp2"])
def test_write_save_clamps_to_prompt_blocks(llama_model_dir: Path, dcp: int) -> None:
    """WRITE producer (full attention): the blocks it pushes are the prompt's
    blocks only, without its 8 lookahead slots, whose blocks the consumer
    never allocated."""
    layout = Layout(block_size=16, window=None, dcp=dcp)
    producer = make_leg_connector(
        llama_model_dir,
        "kv_producer",
        [(["model.layers.0.self_attn.attn"], full_attention_spec(16))],
        read_mode=False,
        dcp=dcp,
    )
    params = {
        "do_remote_decode": True,
        "remote_block_ids": [],
        "remote_engine_id": "decode",
        "remote_host": "127.0.0.1",
        "remote_handshake_port": 1,
        "remote_notify_port": 2,
    }
    wrong: list[str] = []
    for n in range(1, 4 * layout.spans[0] + 1):
        request = make_request(f"w-{n}", n, {**params, "transfer_id": f"w-{n}"})
        table = allocation(layout, n + 8, prefill_id)
        producer.update_state_after_alloc(request, make_kv_cache_blocks(table), 0)
        output = make_scheduler_output()
        output.num_scheduled_tokens = {request.request_id: n}
        meta = producer.build_connector_meta(output)
        saved = meta.reqs_to_save[request.request_id].local_block_ids
        # Every block of positions [0, N - 1), which the decoder needs, at most
        # the prompt's (the decoder computes position N - 1 itself, so a
        # producer may leave out a block that holds nothing else).
        least, most = cdiv(n - 1, layout.spans[0]), cdiv(n, layout.spans[0])
        if not (
            least <= len(saved[0]) <= most
            and list(saved[0]) == table[0][: len(saved[0])]
        ):
            wrong.append(
                f"N={n}: saved {len(saved[0])} blocks, expected {least} to {most}"
            )
    assert not wrong, f"{len(wrong)} wrong: {wrong[:4]}"
