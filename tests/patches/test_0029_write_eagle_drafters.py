"""Patch 0029: WRITE serves EAGLE/EAGLE3 drafters on hybrid (Mamba/KDA) and
sliding-window models.

An EAGLE drafter's layers are attention layers of the target's TP group:
with KV heads of their own they form a group of their own (Qwen3.5-EAGLE3),
else they join the target's full-attention group (gpt-oss-, Ricursive-
EAGLE3). Under WRITE the KV cache coordinator reconciles one prefix hit for
every group (the EAGLE trailing-page drop included), so the prefiller
writes every attention group's pages past that hit, a window group's from
the page of N - W, and the running state slot, as for an MTP drafter.
Drafters WRITE cannot serve (n-gram, whose KV-less speculation no transfer
check covers; a draft model, run at a draft TP size the write's head
mapping does not read) stay refused at start in one line naming the method.

Both legs are real vLLM ``Scheduler``s with prefix caching; the prefiller's
pairs come from its real message handling and write task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
)

NULL = 0
B = 16
WINDOW = 128
ATTN = "model.layers.1.self_attn.attn"
LOCAL = "model.layers.0.self_attn.attn"
KDA = "model.layers.0.linear_attn"
DRAFT = "drafter.model.layers.0.self_attn.attn"
PAGE = full_attention_spec(B).page_size_bytes
# The EAGLE3 configuration resolves offline as MTP, then names its method:
# the connector and the KV cache manager read nothing else of it.
DRAFTED = {"method": "mtp", "num_speculative_tokens": 1}


def _hybrid_own_group() -> list[tuple[list[str], KVCacheSpec]]:
    """Qwen3.5-EAGLE3-like: the drafter's layer (other KV heads, the same
    page size) in an attention group of its own, after the state group."""
    return [
        ([ATTN], full_attention_spec(B)),
        ([KDA], page_kda_spec(B, num_speculative_blocks=1)),
        ([DRAFT], full_attention_spec(B, num_kv_heads=4, head_size=32)),
    ]


def _window_in_target_group() -> list[tuple[list[str], KVCacheSpec]]:
    """gpt-oss-EAGLE3-like: the drafter's layer in the target's full group,
    beside a sliding-window group."""
    return [
        ([ATTN, DRAFT], full_attention_spec(B)),
        ([LOCAL], sliding_window_spec(B, WINDOW)),
    ]


LAYOUTS: dict[str, Any] = {
    "hybrid_own_group": _hybrid_own_group,
    "window_in_target_group": _window_in_target_group,
}


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens"),
    [(18, 0), (100, 0), (130, 0), (100, 48), (200, 64), (66, 32)],
    ids=["18", "100", "130", "100-hit48", "200-hit64", "66-hit32"],
)
def test_prefiller_writes_every_group_the_decoder_lacks_beside_an_eagle_drafter(
    deepseek_mtp_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    layout: str,
    num_tokens: int,
    hit_tokens: int,
) -> None:
    groups = LAYOUTS[layout]()
    pair = build_drafted_write_pair(
        deepseek_mtp_model_dir, monkeypatch, groups, B, DRAFTED, {KDA}, method
    )
    write = pair.write(prompt(2, num_tokens), decode_hit_tokens=hit_tokens)
    assert write.notices == []
    # Every attention group holds the request's hit, the drafter's own group
    # too (WRITE's coordinator reconciles one hit), less the trailing page
    # the KV cache manager drops for an EAGLE drafter; a state group none.
    hit_pages = max(hit_tokens // B - 1, 0)

    def first_page(layer: str) -> int:
        return max(num_tokens - WINDOW, 0) // B if layer == LOCAL else 0

    check_drafted_write(pair, write, num_tokens, hit_pages, first_page)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_drafters_write_cannot_serve_stay_refused_in_one_line(
    deepseek_mtp_model_dir: Path, layout: str, method: str
) -> None:
    """Guard: n-gram and draft-model speculation stay refused at start on a
    hybrid or window model, in one line naming the method."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
        MoRIIOError,
    )

    vllm_config = make_vllm_config(
        deepseek_mtp_model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        block_size=B,
        speculative_config=DRAFTED,
    )
    assert vllm_config.speculative_config is not None
    vllm_config.speculative_config.method = method  # type: ignore[assignment]
    with pytest.raises((NotImplementedError, MoRIIOError)) as refused:
        make_scheduler_connector(vllm_config, make_kv_cache_config(LAYOUTS[layout]()))
    assert f"method={method!r}" in str(refused.value)
    assert "\n" not in str(refused.value)
