"""Patch 0002: trim every transfer group to the prompt's blocks before the
sliding-window clip, at both exchange points.

Each leg's table is shaped as vLLM's KV cache manager allocates it: the
prompt's blocks plus the blocks of the lookahead slots that leg reserves.
P's ``request_finished_all_groups`` builds ``remote_block_ids``; D's
``update_state_after_alloc`` pairs them with its own table; D's
``build_connector_meta`` hands the pairs to the workers. Every pair must hold
the same positions on both legs, and every decoder block holding a position
the last prompt token needs must be read (see ``pairing_0002``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.patches.conftest import (
    full_attention_spec,
    make_kv_cache_blocks,
    make_kv_cache_config,
    make_request,
    make_scheduler_connector,
    make_scheduler_output,
    make_vllm_config,
    moriio_kv_transfer_config,
)
from tests.patches.pairing_0002 import (
    MAX_PROMPT_TOKENS,
    SMALL,
    SWEEPS,
    Case,
    Layout,
    LegPair,
    allocation,
    build_leg_pair,
    cdiv,
    pairing_errors,
    prefill_id,
    sweep,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager


@pytest.fixture(scope="module")
def leg_pairs(llama_model_dir: Path) -> Callable[[Layout], LegPair]:
    """One real producer/consumer pair per layout, reused across tests."""
    pairs: dict[Layout, LegPair] = {}

    def get(layout: Layout) -> LegPair:
        if layout not in pairs:
            pairs[layout] = build_leg_pair(
                llama_model_dir, layout, MAX_PROMPT_TOKENS + 64
            )
        return pairs[layout]

    return get


def assert_paired(pair: LegPair, n: int, prefill_tail: int, decode_tail: int) -> None:
    table = allocation(
        pair.layout, pair.layout.num_prefilled(n) + prefill_tail, prefill_id
    )
    lists = pair.exchange(n, table, decode_tail)
    errors = pairing_errors(pair.layout, n, lists)
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
@pytest.mark.parametrize("sweep_name", list(SWEEPS))
def test_sweep_reads_every_needed_block(
    leg_pairs: Callable[[Layout], LegPair], sweep_name: str
) -> None:
    cases = SWEEPS[sweep_name]
    wrong = sweep(leg_pairs(cases[0].layout), cases, range(1, MAX_PROMPT_TOKENS + 1))
    summary = {name: (len(ns), ns[:8]) for name, ns in wrong.items() if ns}
    assert not summary, f"wrong prompt lengths (count, first): {summary}"


def scheduler_handoff(
    pair: LegPair, table: Sequence[Sequence[int]], num_computed_tokens: int
) -> list[list[int]]:
    """P's table as vLLM's scheduler hands it to ``request_finished``: its own
    clip to the computed tokens (``KVCacheManager.get_block_ids_for_computed_
    tokens``), which divides by the spec block size without the DCP factor."""
    manager = SimpleNamespace(
        get_block_ids=lambda request_id: tuple(list(g) for g in table),
        kv_cache_config=pair.kv_cache_config,
    )
    return [
        list(g)
        for g in KVCacheManager.get_block_ids_for_computed_tokens(
            manager,  # type: ignore[arg-type]
            request_id="p",
            num_computed_tokens=num_computed_tokens,
        )
    ]


@pytest.mark.parametrize("dcp", [1, 2], ids=["dcp1", "dcp2"])
@pytest.mark.parametrize("handoff", ["allocation", "scheduler"])
def test_full_attention_prefiller_tail(
    leg_pairs: Callable[[Layout], LegPair], handoff: str, dcp: int
) -> None:
    """Only the prefiller holds lookahead slots (8 past the prompt)."""
    layout = Layout(block_size=16, window=None, dcp=dcp)
    pair = leg_pairs(layout)
    span = layout.spans[0]
    wrong: list[str] = []
    for n in range(1, 4 * span + 1):
        table = allocation(layout, n + 8, prefill_id)
        if handoff == "scheduler":
            table = scheduler_handoff(pair, table, n)
        errors = pairing_errors(layout, n, pair.exchange(n, table, 0))
        if errors:
            wrong.append(f"N={n}: {errors[0]}")
    assert not wrong, f"{len(wrong)} wrong: {wrong[:4]}"


@pytest.mark.parametrize(
    ("window", "prefill_tail", "decode_tail", "dcp"),
    [
        (128, 0, 9, 1),
        (128, 9, 0, 1),
        (128, 9, 0, 2),
        (None, 0, 9, 1),
        (None, 9, 0, 2),
    ],
    ids=[
        "only_decoder",
        "only_prefiller",
        "only_prefiller-dcp2",
        "full-only_decoder",
        "full-only_prefiller-dcp2",
    ],
)
def test_hybrid_read_one_sided_tail(
    leg_pairs: Callable[[Layout], LegPair],
    window: int | None,
    prefill_tail: int,
    decode_tail: int,
    dcp: int,
) -> None:
    """Hybrid READ (full attention, a sliding-window group unless ``window``
    is None, and a KDA group): the prefiller computes the prompt without its
    last token, and both legs trim to those tokens' blocks before the window
    clip."""
    layout = Layout(block_size=64, window=window, dcp=dcp, mamba=True)
    case = Case("hybrid", layout, prefill_tail, decode_tail)
    wrong = sweep(leg_pairs(layout), [case], range(1, 1025))["hybrid"]
    assert not wrong, f"{len(wrong)} wrong prompt lengths, first {wrong[:8]}"


@pytest.mark.parametrize("dcp", [1, 2], ids=["dcp1", "dcp2"])
def test_write_save_clamps_to_prompt_blocks(llama_model_dir: Path, dcp: int) -> None:
    """WRITE producer (full attention): the blocks it pushes are the prompt's
    blocks only, without its 8 lookahead slots, whose blocks the consumer
    never allocated."""
    layout = Layout(block_size=16, window=None, dcp=dcp)
    vllm_config = make_vllm_config(
        llama_model_dir, moriio_kv_transfer_config("kv_producer", read_mode=False)
    )
    vllm_config.parallel_config.decode_context_parallel_size = dcp
    producer = make_scheduler_connector(
        vllm_config,
        make_kv_cache_config(
            [(["model.layers.0.self_attn.attn"], full_attention_spec(16))]
        ),
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
        expected = [table[0][: cdiv(n, layout.spans[0])]]
        if [list(g) for g in saved] != expected:
            wrong.append(
                f"N={n}: saved {len(saved[0])} blocks, expected {len(expected[0])}"
            )
    assert not wrong, f"{len(wrong)} wrong: {wrong[:4]}"
