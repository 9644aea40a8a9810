"""Patch 0040: WRITE serves sliding-window models with an MTP drafter
(DeepSeek-V4-Pro-MTP, DeepSeek-V4.1-MTP, Step5-MTP).

An MTP drafter's layers are attention layers of the target's TP group, in
the target's groups or in groups of the target's specs (a window one
included). Under WRITE the KV cache coordinator reconciles one prefix hit
for every group (less the trailing page vLLM drops for the drafter), so the
prefiller writes every attention group's pages past that hit, a window
group's from the page of N - W, and a state group's running slot; the
decoder's lookahead pages past N - 1 are its own. WRITE refused every
drafter but EAGLE's beside window groups at start; a drafter reading more
than one prefill token ahead (multi-module MTP) stays refused there.

Both legs are real vLLM ``Scheduler``s with prefix caching; the prefiller's
pairs come from its real message handling and write task.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from vllm.v1.kv_cache_interface import KVCacheSpec

from tests.patches.builders import (
    build_drafted_write_pair,
    check_drafted_write,
    full_attention_spec,
    make_kv_cache_config,
    make_scheduler_connector,
    make_vllm_config,
    moriio_kv_transfer_config,
    page_kda_spec,
    prompt,
    sliding_window_spec,
    write_model_dir,
)
from tests.patches.conftest import TINY_DEEPSEEK_MTP_CONFIG

B = 16
WINDOW = 128
ATTN = "model.layers.1.self_attn.attn"
LOCAL = "model.layers.0.self_attn.attn"
KDA = "model.layers.2.linear_attn"
DRAFT = "model.layers.61.self_attn.attn"
DRAFT_LOCAL = "model.layers.61.self_attn.swa"
MTP = {"method": "mtp", "num_speculative_tokens": 1}

Groups = list[tuple[list[str], KVCacheSpec]]


def _drafter_in_full_group() -> Groups:
    """The drafter's layer in the target's full group, beside a window."""
    return [
        ([ATTN, DRAFT], full_attention_spec(B)),
        ([LOCAL], sliding_window_spec(B, WINDOW)),
    ]


def _drafter_window_group() -> Groups:
    """DeepSeek-V4-like: the drafter's window layer in a window group of its
    own (a drafter spec)."""
    return [
        ([ATTN], full_attention_spec(B)),
        ([LOCAL], sliding_window_spec(B, WINDOW)),
        ([DRAFT_LOCAL], replace(sliding_window_spec(B, WINDOW), is_draft=True)),
    ]


def _hybrid_window() -> Groups:
    """A window beside a state group with its drafter's scratch slot, the
    drafter's layer in the target's full group."""
    return [
        ([ATTN, DRAFT], full_attention_spec(B)),
        ([LOCAL], sliding_window_spec(B, WINDOW)),
        ([KDA], page_kda_spec(B, num_speculative_blocks=1)),
    ]


LAYOUTS: dict[str, Callable[[], Groups]] = {
    "drafter_in_full_group": _drafter_in_full_group,
    "drafter_window_group": _drafter_window_group,
    "hybrid_window": _hybrid_window,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens"),
    [(18, 0), (100, 0), (130, 0), (175, 0), (100, 48), (200, 64), (175, 96)],
    ids=["18", "100", "130", "window_start_175", "100-hit48", "200-hit64", "175-hit96"],
)
def test_prefiller_writes_the_window_the_decoder_lacks_beside_an_mtp_drafter(
    deepseek_mtp_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
    num_tokens: int,
    hit_tokens: int,
) -> None:
    """Every attention group's pages past the decoder's hit (less the page
    vLLM drops for the drafter) up to the page of N - 2, a window group's
    from the page of N - W, each into the decoder's page of the same
    positions, none a null page; the state's running slot. N % B == B - 1
    puts N - W at the last slot of its page."""
    pair = build_drafted_write_pair(
        deepseek_mtp_model_dir, monkeypatch, LAYOUTS[layout](), B, MTP, {KDA}
    )
    write = pair.write(prompt(41, num_tokens), decode_hit_tokens=hit_tokens)
    assert write.notices == []
    hit_pages = max(hit_tokens // B - 1, 0)
    window_start = max(num_tokens - WINDOW, 0) // B

    def first_page(layer: str) -> int:
        return window_start if layer in (LOCAL, DRAFT_LOCAL) else 0

    check_drafted_write(pair, write, num_tokens, hit_pages, first_page)


def test_multi_module_mtp_beside_a_window_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    """MTP with two modules reads two prefill tokens ahead, and vLLM keeps
    that many more window positions than the prefiller writes: refused at
    start in one line naming the method and its lookahead."""
    model_dir = write_model_dir(
        tmp_path, {**TINY_DEEPSEEK_MTP_CONFIG, "num_nextn_predict_layers": 2}
    )
    vllm_config = make_vllm_config(
        model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        block_size=B,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    assert vllm_config.num_prefill_lookahead_tokens == 2
    with pytest.raises(NotImplementedError) as refused:
        make_scheduler_connector(
            vllm_config, make_kv_cache_config(_drafter_in_full_group())
        )
    assert "method='mtp' reading 2" in str(refused.value)
    assert "\n" not in str(refused.value)
