"""READ pairs window pages by position and never reads a null block.

The decoder recomputes the last prompt token, position N-1, whose window
reads positions [N-W, N-1). It pairs the pages of that window with the same
pages of the prefiller's list and refuses a payload that cannot supply one
of them (a page freed to the null block, a list that starts past it), never
READing the null block or the wrong page. WRITE refuses window groups.

The sweeps hand the real connectors tables shaped the way vLLM's KV cache
managers leave them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    MoRIIOError,
)
from vllm.v1.core.kv_cache_planning import unify_hybrid_kv_cache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec

from tests.patches.builders import (
    Case,
    Layout,
    LegPair,
    full_and_window_groups,
    make_kv_cache_blocks,
    make_kv_cache_config,
    make_request,
    make_scheduler_connector,
    make_vllm_config,
    moriio_kv_transfer_config,
    sliding_window_spec,
    sweep,
)

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
