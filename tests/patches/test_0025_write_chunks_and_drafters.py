"""Patch 0025: WRITE serves the layouts READ serves: chunked local attention
groups (Llama 4) and hybrids with an MTP drafter.

A chunked local attention group of chunk C is paired as a window group is:
the prefiller computes N - 1 tokens and writes, page by page into the same
positions, the pages of positions [S, N - 1) past the decoder's prefix hit
L, S = C * ((N - 1) // C) the start of the chunk of the token the decoder
recomputes; the full-attention group gets [L, N - 1). A hybrid (KDA/Mamba)
with an MTP drafter, in the target's group or in a group of the target's
spec of its own, is written as any hybrid is: every attention group's pages
past the hit, the running state slot. Other drafters (n-gram, a draft
model) stay refused.

Both legs are real vLLM ``Scheduler``s with prefix caching; the prefiller's
pairs come from its real message handling and write task.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheSpec

from tests.patches.builders import (
    LAYER,
    Write,
    WritePair,
    build_drafted_write_pair,
    build_write_pair,
    check_drafted_write,
    chunked_local_spec,
    full_attention_spec,
    kda_mamba_spec,
    make_kv_cache_config,
    make_scheduler_connector,
    make_vllm_config,
    mla_spec,
    moriio_kv_transfer_config,
    page_kda_spec,
    prompt,
)

NULL = 0
LOCAL = "model.layers.0.self_attn.attn"
GLOBAL = "model.layers.3.self_attn.attn"


def _llama4_pair(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, block_size: int, chunk: int
) -> WritePair:
    """Llama 4's groups under the hybrid manager: chunked local, full."""
    groups: list[tuple[list[str], KVCacheSpec]] = [
        ([LOCAL], chunked_local_spec(block_size, chunk)),
        ([GLOBAL], full_attention_spec(block_size)),
    ]
    return build_write_pair(model_dir, groups, block_size, monkeypatch)


def _chunk_pairs(
    write: Write, group: int, block_size: int, chunk: int | None
) -> list[tuple[int, int]]:
    """P's page k to D's page k for every page the decoder lacks holding a
    position in [S, N - 1) (S = 0 for full attention)."""
    n = write.num_prompt_tokens
    first = (n - 1) // chunk * chunk // block_size if chunk else 0
    first = max(first, write.decode_hit_tokens // block_size)
    return [
        (write.prefill_tables[group][k], write.decode_tables[group][k])
        for k in range(first, cdiv(n - 1, block_size))
    ]


# C 64: N - 1 inside a chunk (100, 200), at a chunk's start (65, 129: the
# chunk group writes nothing), N at a chunk's end (128), past two chunks.
@pytest.mark.parametrize("block_size", [16, 32], ids=["b16", "b32"])
@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens"),
    [
        (100, 0),
        (65, 0),
        (128, 0),
        (129, 0),
        (200, 0),
        (300, 0),
        (200, 96),
        (200, 160),
        (300, 288),
    ],
    ids=[
        "100",
        "chunk_start_65",
        "chunk_end_128",
        "chunk_start_129",
        "200",
        "300",
        "200-hit_below_chunk",
        "200-hit_in_chunk",
        "300-hit_in_chunk",
    ],
)
def test_prefiller_writes_the_chunk_the_decoder_lacks(
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    block_size: int,
    num_tokens: int,
    hit_tokens: int,
) -> None:
    chunk = 64
    pair = _llama4_pair(llama_model_dir, monkeypatch, block_size, chunk)
    write = pair.write(prompt(1, num_tokens), decode_hit_tokens=hit_tokens)
    assert write.notices == []
    assert write.message["num_held_blocks"] == [hit_tokens // block_size] * 2
    for group, group_chunk in enumerate([chunk, None]):
        pairs = write.group_pairs[group]
        assert pairs == _chunk_pairs(write, group, block_size, group_chunk)
        assert all(NULL not in p for p in pairs)
    # The decoder counts N - 1 - L tokens external: its table keeps the
    # chunk's pages, the prefiller's too (its last computed token is N - 2).
    start = (num_tokens - 1) // chunk * chunk // block_size
    for table in (write.decode_tables[0], write.prefill_tables[0]):
        assert NULL not in table[start : cdiv(num_tokens - 1, block_size)]


def test_chunk_group_beside_a_state_group_is_refused_in_one_line(
    llama_model_dir: Path,
) -> None:
    """WRITE pairs chunk pages by position (as window pages) without state
    groups, and under DCP 1 only where it serves them beside state groups:
    beside one under DCP 2, refused at start naming the group."""
    vllm_config = make_vllm_config(
        llama_model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        block_size=16,
    )
    vllm_config.parallel_config.decode_context_parallel_size = 2
    groups: list[tuple[list[str], KVCacheSpec]] = [
        ([LOCAL], chunked_local_spec(16, 64)),
        ([GLOBAL], full_attention_spec(16)),
        ([f"{LAYER}.kda"], kda_mamba_spec(16)),
    ]
    with pytest.raises(
        NotImplementedError,
        match=r"chunked local attention cache groups (beside Mamba state groups|"
        r"under decode context parallelism \(DCP 2\)): group 0 \(model\.layers\.0",
    ):
        make_scheduler_connector(vllm_config, make_kv_cache_config(groups))


B = 16
ATTN = "model.layers.1.self_attn.attn"
DRAFT = "model.layers.61.self_attn.attn"
KDA = "model.layers.0.linear_attn"
PAGE = full_attention_spec(B).page_size_bytes
MTP = {"method": "mtp", "num_speculative_tokens": 1}
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 2,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def _mtp_in_target_group() -> list[tuple[list[str], KVCacheSpec]]:
    """Kimi-K3-MTP-like: the drafter's layer in the target's MLA group."""
    return [
        ([ATTN, DRAFT], mla_spec(B, page_size_padded=PAGE)),
        ([KDA], page_kda_spec(B, num_speculative_blocks=1)),
    ]


def _mtp_own_group() -> list[tuple[list[str], KVCacheSpec]]:
    """Qwen3.5-MTP-like with the drafter's layer in a group of its own (an
    equal spec in another group), after the state group."""
    full = full_attention_spec(B)
    return [
        ([ATTN], full),
        ([KDA], page_kda_spec(B, num_speculative_blocks=1)),
        ([DRAFT], replace(full)),
    ]


DRAFTED: dict[str, Any] = {
    "mtp_in_target_group": _mtp_in_target_group,
    "mtp_own_group": _mtp_own_group,
}


@pytest.mark.parametrize("layout", list(DRAFTED))
@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens"),
    [(18, 0), (100, 0), (130, 0), (100, 48), (130, 64), (66, 32)],
    ids=["18", "100", "130", "100-hit48", "130-hit64", "66-hit32"],
)
def test_drafted_hybrid_writes_attention_pages_the_decoder_lacks_and_the_state(
    deepseek_mtp_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
    num_tokens: int,
    hit_tokens: int,
) -> None:
    groups = DRAFTED[layout]()
    pair = build_drafted_write_pair(
        deepseek_mtp_model_dir, monkeypatch, groups, B, MTP, {KDA}
    )
    write = pair.write(prompt(2, num_tokens), decode_hit_tokens=hit_tokens)
    assert write.notices == []
    held = write.message["num_held_blocks"]
    # Every attention group holds the request's hit (the drafter's own group
    # too: WRITE's coordinator reconciles one hit), a state group none. With
    # an MTP drafter the KV cache manager drops the trailing page of a hit.
    hit_pages = max(hit_tokens // B - 1, 0)
    attention = [g for g, (names, _) in enumerate(groups) if KDA not in names]
    assert {held[g] for g in attention} == {hit_pages}
    check_drafted_write(pair, write, num_tokens, hit_pages)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_other_speculative_methods_stay_refused_in_one_line(
    deepseek_mtp_model_dir: Path, method: str
) -> None:
    """Guard: a hybrid WRITE with a drafter of another method is refused at
    start naming it: n-gram, whose transfer nothing checks, and a draft
    model, whose layers can run at another TP size than the target's. (The
    draft-model configuration resolves offline as MTP, then names its
    method: the connector reads nothing else of it.)"""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
        MoRIIOError,
    )

    vllm_config = make_vllm_config(
        deepseek_mtp_model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        block_size=B,
        speculative_config=NGRAM if method == "ngram" else MTP,
    )
    assert vllm_config.speculative_config is not None
    vllm_config.speculative_config.method = method  # type: ignore[assignment]
    with pytest.raises(MoRIIOError, match=f"method='{method}'"):
        make_scheduler_connector(
            vllm_config, make_kv_cache_config(_mtp_in_target_group())
        )
