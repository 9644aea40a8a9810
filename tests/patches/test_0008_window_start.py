"""Patch 0008: READ keeps the first block of the decoder's sliding window.

The decoder recomputes the last prompt token, position N-1, whose window
reads positions [N-W, N-1). When the prefill of N tokens finishes, vLLM's
scheduler frees every window block below the window of token N (positions
below N-W+1) before the connector builds its payload. Whenever N-W is the
last slot of its block, that block is the null block in the prefiller's list
and the decoder READs it into a live page. The prefiller now computes N-1
tokens when the model has a window group, and the decoder pairs window pages
by position and refuses any null block among the pages it needs.

The first tests run a real prefill scheduler and a real decode scheduler
(each with its KV cache manager and the MoRIIO connector); the sweeps hand
the real connectors tables shaped the way those managers leave them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    MoRIIOError,
)
from vllm.v1.core.kv_cache_planning import unify_hybrid_kv_cache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec

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
    make_kv_cache_blocks,
    make_kv_cache_config,
    make_request,
    make_scheduler_connector,
    make_vllm_config,
    moriio_kv_transfer_config,
    prompt,
    scheduler_pair_cache,
    sliding_window_spec,
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
    """N-W ends its block (N % 16 == 15 for W = 64): the prefill computes N-1
    tokens, so its scheduler keeps the block holding N-W."""
    pair = scheduler_pairs(16, 64)
    for n in (95, 111, 207):
        read = pair.read(prompt(n, n))
        assert read.num_prefilled_tokens == n - 1
        assert read.prefill_tables[1][(n - 64) // 16] != 0


# ---------------------------------------------------------------------------
# Fail closed
# ---------------------------------------------------------------------------


def _consumer(model_dir: Path, block_size: int, window: int) -> Any:
    vllm_config = make_vllm_config(
        model_dir, moriio_kv_transfer_config("kv_consumer"), block_size=block_size
    )
    return make_scheduler_connector(
        vllm_config, make_kv_cache_config(full_and_window_groups(block_size, window))
    )


_READ_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill",
    "remote_host": "127.0.0.1",
    "remote_handshake_port": 1,
    "remote_notify_port": 2,
    "transfer_id": "t-0",
}


@pytest.mark.parametrize(
    "remote_window",
    [
        # What a prefill of all N tokens sends: page 1 (N-W = 31) was freed.
        [0, 109, 110, 111, 112],
        # A prefill list that starts past the window's first page.
        [109, 110, 111, 112],
    ],
    ids=["null_window_start", "short_list"],
)
def test_read_without_the_window_start_fails_closed(
    llama_model_dir: Path, remote_window: list[int]
) -> None:
    """N = 95, W = 64, B = 16: the decoder needs pages 1..5 of the window
    group. A prefill payload that cannot supply page 1 is an error, never a
    READ of the null block or of the wrong page."""
    n = 95
    consumer = _consumer(llama_model_dir, 16, 64)
    request = make_request("req-95", n, {**_READ_PARAMS})
    request.kv_transfer_params["remote_block_ids"] = [
        list(range(101, 107)),
        remote_window,
    ]
    scheduler = consumer.connector_scheduler
    external, _ = scheduler.get_num_new_matched_tokens(request, 0)
    decode_tables = [list(range(201, 207)), [0, 302, 303, 304, 305, 306]]
    with pytest.raises(MoRIIOError, match="cannot guarantee the sliding window"):
        scheduler.update_state_after_alloc(
            request, make_kv_cache_blocks(decode_tables), external
        )


def test_write_refuses_a_window_group_without_hma(llama_model_dir: Path) -> None:
    """A model whose layers all use one window keeps its window group with the
    hybrid KV cache manager disabled; the prefill's scheduler frees the first
    block of the decoder's window before a WRITE push can complete. (The
    series later serves such groups in WRITE with DCP 1; under DCP 2, the
    layout here, they stay refused.)"""
    vllm_config = make_vllm_config(
        llama_model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        disable_hybrid_kv_cache_manager=True,
    )
    vllm_config.parallel_config.decode_context_parallel_size = 2
    kv_cache_config = make_kv_cache_config(
        [(["model.layers.0.self_attn.attn"], sliding_window_spec(16, 64))]
    )
    with pytest.raises(NotImplementedError, match="sliding-window cache groups"):
        make_scheduler_connector(vllm_config, kv_cache_config)


@pytest.mark.parametrize("disable_hma", [False, True], ids=["hma", "no_hma"])
def test_write_full_and_window_layers(llama_model_dir: Path, disable_hma: bool):
    """WRITE with full and window layers: refused with HMA (under DCP 2, which
    the series never serves in WRITE); without it vLLM gives the window
    layers full-attention groups, which free nothing."""
    vllm_config = make_vllm_config(
        llama_model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        disable_hybrid_kv_cache_manager=disable_hma,
    )
    if not disable_hma:
        vllm_config.parallel_config.decode_context_parallel_size = 2
    groups = full_and_window_groups(16, 64)
    if disable_hma:
        # What vLLM's planner makes of these layers without HMA.
        specs = {names[0]: spec for names, spec in groups}
        unify_hybrid_kv_cache_specs(specs)
        assert all(isinstance(s, FullAttentionSpec) for s in specs.values())
        groups = [([name], spec) for name, spec in specs.items()]
        make_scheduler_connector(vllm_config, make_kv_cache_config(groups))
        return
    with pytest.raises(NotImplementedError, match="sliding-window cache groups"):
        make_scheduler_connector(vllm_config, make_kv_cache_config(groups))


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
    lookahead tail, a small window with tails of 1..8 slots, DCP 2 and 4):
    with the prefiller's freed window blocks they pass only with this fix."""
    cases = SWEEPS[sweep_name]
    wrong = sweep(leg_pairs(cases[0].layout), cases, range(1, SWEPT_TOKENS + 1))
    summary = {name: (len(ns), ns[:8]) for name, ns in wrong.items() if ns}
    assert not summary, f"wrong prompt lengths (count, first): {summary}"


@pytest.mark.parametrize(
    ("prefill_tail", "decode_tail", "dcp"),
    [(0, 9, 1), (9, 0, 1), (9, 0, 2)],
    ids=["only_decoder", "only_prefiller", "only_prefiller-dcp2"],
)
def test_hybrid_read_one_sided_tail(
    leg_pairs: Callable[[Layout], LegPair],
    prefill_tail: int,
    decode_tail: int,
    dcp: int,
) -> None:
    """Hybrid READ (full attention, a window group and a KDA group) with a
    lookahead tail on one leg: the window pages pair by position and none is
    the null block."""
    layout = Layout(block_size=64, window=128, dcp=dcp, mamba=True)
    case = Case("hybrid", layout, prefill_tail, decode_tail)
    wrong = sweep(leg_pairs(layout), [case], range(1, 1025))["hybrid"]
    assert not wrong, f"{len(wrong)} wrong prompt lengths, first {wrong[:8]}"
