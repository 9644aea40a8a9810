"""Patch 0039: WRITE serves sliding-window and chunked local attention groups
beside Mamba state groups (LFM3: ShortConv + full + a 256-token window).

The prefiller of such a model computes N - 1 prompt tokens and writes each
window group's pages from the page of N - W (a chunk group's from the start
of the chunk of N - 1) past the decoder's hit, each full-attention group's
past that hit, and each state group's running slot; a null page among the
attention pages it pairs writes nothing and the decoder recomputes the
request. WRITE refused these layouts at start.

The scheduler side runs on two real vLLM ``Scheduler``s with prefix caching;
the prefiller's pairs come from its real message handling and write task.
The worker side is the real WRITE-mode ``MoRIIOConnectorWorker``
registering the KV cache tensors vLLM lays out, its ``MoRIIOWriter``
checking the pages of a transfer.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_engine
from vllm.v1.kv_cache_interface import KVCacheSpec

from tests.patches.builders import (
    WritePair,
    build_drafted_write_pair,
    check_drafted_write,
    chunked_local_spec,
    full_attention_spec,
    make_vllm_config,
    moriio_kv_transfer_config,
    page_kda_spec,
    prompt,
    register_worker,
    sliding_window_spec,
)
from tests.patches.test_0021_any_mamba_state_count import short_conv_spec

NULL = 0
B = 16
WINDOW = 64
CHUNK = 64
FULL = "model.layers.2.self_attn.attn"
LOCAL = "model.layers.4.self_attn.attn"
CONV = "model.layers.0.short_conv"
KDA = "model.layers.1.linear_attn"

Groups = list[tuple[list[str], KVCacheSpec]]


def _short_conv_window() -> Groups:
    """LFM3-like: a ShortConv state (one conv array) beside full attention
    and a sliding window."""
    return [
        ([FULL], full_attention_spec(B)),
        ([LOCAL], sliding_window_spec(B, WINDOW)),
        ([CONV], short_conv_spec()),
    ]


def _kda_window() -> Groups:
    """A conv + SSM state beside full attention and a sliding window."""
    return [
        ([FULL], full_attention_spec(B)),
        ([LOCAL], sliding_window_spec(B, WINDOW)),
        ([KDA], page_kda_spec(B)),
    ]


def _kda_chunk() -> Groups:
    """A conv + SSM state beside full and chunked local attention."""
    return [
        ([LOCAL], chunked_local_spec(B, CHUNK)),
        ([FULL], full_attention_spec(B)),
        ([KDA], page_kda_spec(B)),
    ]


LAYOUTS: dict[str, Callable[[], Groups]] = {
    "short_conv-window": _short_conv_window,
    "kda-window": _kda_window,
    "kda-chunk": _kda_chunk,
}


def _pair(model_dir: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> WritePair:
    return build_drafted_write_pair(
        model_dir, monkeypatch, LAYOUTS[layout](), B, None, {CONV, KDA}
    )


def _first_page(layout: str, num_tokens: int) -> Callable[[str], int]:
    """The page of the first position the decoder's recomputed token N - 1
    attends to in the local group: N - W, or the start of its chunk."""
    if layout.endswith("chunk"):
        start = (num_tokens - 1) // CHUNK * CHUNK
    else:
        start = max(num_tokens - WINDOW, 0)
    return lambda layer: start // B if layer == LOCAL else 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens"),
    [(18, 0), (100, 0), (111, 0), (113, 0), (130, 0), (200, 64), (200, 160)],
    ids=[
        "18",
        "100",
        "window_start_111",
        "113",
        "130",
        "200-hit64",
        "200-hit160",
    ],
)
def test_prefiller_writes_the_window_and_the_state_the_decoder_lacks(
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
    num_tokens: int,
    hit_tokens: int,
) -> None:
    """The local group's pages from the page of its first attended position
    past the decoder's hit, the full group's past the hit, each into the
    decoder's page of the same positions and none a null page; the state
    group's running slot into the decoder's. N % B == B - 1 puts N - W at
    the last slot of its page (the window start the prefiller frees when it
    computes N tokens)."""
    pair = _pair(llama_model_dir, monkeypatch, layout)
    write = pair.write(prompt(39, num_tokens), decode_hit_tokens=hit_tokens)
    assert write.notices == []
    assert not write.released
    check_drafted_write(
        pair, write, num_tokens, hit_tokens // B, _first_page(layout, num_tokens)
    )


def test_null_window_page_writes_nothing_beside_a_state_group(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A null page among the decoder's window pages to write (a decoder
    whose allocation freed its window start): no layer is written, the
    state's neither; the prefiller releases its blocks and tells the decoder
    the write failed (it recomputes the request)."""
    pair = _pair(llama_model_dir, monkeypatch, "short_conv-window")

    def null_window_start(message: dict[str, Any]) -> None:
        message["block_notify_list"][1][(111 - WINDOW) // B] = NULL

    write = pair.write(prompt(40, 111), message=null_window_start)
    assert write.pairs_by_layer == {}
    assert write.notices == ["write_failed"]
    assert write.released


def _write_task(local: list[list[int]], starts: list[int] | None) -> Any:
    return types.SimpleNamespace(
        request_id="r", local_block_ids=local, write_start_blocks=starts
    )


def test_real_worker_checks_attention_pages_not_state_slots(
    copying_mori: None, llama_model_dir: Path
) -> None:
    """The prefiller's real worker and writer: a null page among the window
    pages it pairs is refused naming the group; the state group's one slot
    list is not paired page by page, so a write of it passes the check."""
    vllm_config = make_vllm_config(
        llama_model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        block_size=B,
    )
    layer_specs = {names[0]: spec for names, spec in _short_conv_window()}
    registered = register_worker(vllm_config, layer_specs, "LBNHC", "127.0.0.1:p")
    try:
        groups = registered.kv_cache_config.transfer_groups
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        window = kinds.index("SlidingWindowSpec")
        state = kinds.index("MambaSpec")
        writer = moriio_engine.MoRIIOWriter(registered.worker)
        # Positions [0, 112): 7 pages per attention group, the window's from
        # page 3 (N = 113, N - W = 49); the state group's running slot.
        local = [[9] if g == state else list(range(1, 8)) for g in range(len(groups))]
        remote = [
            [7] if g == state else list(range(21, 28)) for g in range(len(groups))
        ]
        starts = [3 if g == window else 0 for g in range(len(groups))]
        info = types.SimpleNamespace(block_ids=remote, num_held_blocks=None)
        assert writer._unwritable_pages(_write_task(local, starts), info) is None
        below_window = [list(x) for x in local]
        below_window[window][2] = NULL
        assert writer._unwritable_pages(_write_task(below_window, starts), info) is None
        in_window = [list(x) for x in local]
        in_window[window][3] = NULL
        reason = writer._unwritable_pages(_write_task(in_window, starts), info)
        assert reason is not None
        assert reason.startswith(f"group {window}: the prefiller's page 0 ")
    finally:
        registered.worker.shutdown()
