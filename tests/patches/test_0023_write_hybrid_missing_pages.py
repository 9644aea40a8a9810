"""Patch 0023: hybrid (KDA/Mamba) WRITE writes the attention pages the
decoder lacks and no other, and the recurrent state it needs.

A hybrid decoder with a local prefix hit of L tokens loads N - 1 - L
(it recomputes the last prompt token from the pushed state h(N - 1)): the
prefiller writes each attention group's pages of positions [L, N - 1) and
each state group's running slot, never the pages of the hit.

Both legs are real vLLM ``Scheduler``s with prefix caching (state groups in
"align" mode, so a hit holds its state); the prefiller's pairs come from its
real message handling and write planners. Block size 16; a decoder hit is
made by running a prompt sharing the prefix on the decode leg first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheSpec

from tests.patches.builders import (
    Write,
    WritePair,
    full_attention_spec,
    mla_spec,
    page_kda_spec,
    prompt,
    write_pair_fixture,
    write_params,
)

B = 16
ATTN = "model.layers.1.self_attn.attn"
ATTN2 = "model.layers.3.self_attn.attn"
KDA = "model.layers.0.linear_attn"
# A page every state fits in: 16 tokens x 2 KV heads x 64 x bf16 x K, V.
PAGE = full_attention_spec(B).page_size_bytes


def kimi_like() -> list[tuple[list[str], KVCacheSpec]]:
    """One MLA group and one KDA state group."""
    return [([ATTN], mla_spec(B, page_size_padded=PAGE)), ([KDA], page_kda_spec(B))]


def two_attention_groups() -> list[tuple[list[str], KVCacheSpec]]:
    """Two attention groups (a second spec) beside a state group, state in
    the middle: the counts are per group, in transfer-group order."""
    full = full_attention_spec(B)
    return [
        ([ATTN], full),
        ([KDA], page_kda_spec(B)),
        ([ATTN2], replace(full, head_size=32, page_size_padded=PAGE)),
    ]


LAYOUTS: dict[str, Callable[[], list[tuple[list[str], KVCacheSpec]]]] = {
    "kimi_like": kimi_like,
    "two_attention_groups": two_attention_groups,
}


pair = write_pair_fixture(LAYOUTS, B)


def attention_pairs(write: Write, group: int, first_page: int) -> list[tuple[int, int]]:
    """P's page k paired with D's page k for every page from ``first_page``
    holding a position below N - 1."""
    last = cdiv(write.num_prompt_tokens - 1, B)
    prefill, decode = write.prefill_tables[group], write.decode_tables[group]
    return [(prefill[k], decode[k]) for k in range(first_page, last)]


def assert_write(write: WritePair, result: Write, first_page: int) -> None:
    for layer, group in write.layers.items():
        pairs = result.pairs_by_layer[layer]
        if layer in write.state_layers:
            # One running slot on each leg, whatever the hit.
            assert len(pairs) == 1, layer
            ((prefill_slot, decode_slot),) = pairs
            assert prefill_slot in result.prefill_tables[group]
            assert decode_slot == result.message["block_notify_list"][group][-1]
        else:
            assert pairs == attention_pairs(result, group, first_page), layer


@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens"),
    [(100, 48), (66, 32), (34, 16), (65, 48), (130, 64)],
    ids=["partial", "last_page_alone", "one_page_held", "aligned_prompt", "long"],
)
def test_hybrid_prefiller_writes_only_attention_pages_the_decoder_lacks(
    pair: WritePair, num_tokens: int, hit_tokens: int
) -> None:
    write = pair.write(prompt(1, num_tokens), decode_hit_tokens=hit_tokens)
    assert write.message["num_held_blocks"] == [
        0 if layer in pair.state_layers else hit_tokens // B for layer in pair.layers
    ]
    assert_write(pair, write, hit_tokens // B)


@pytest.mark.parametrize("num_tokens", [18, 66, 130])
def test_hybrid_without_a_hit_writes_every_needed_page(
    pair: WritePair, num_tokens: int
) -> None:
    """Guard: no hit, every attention page below N - 1 and the state."""
    write = pair.write(prompt(2, num_tokens))
    assert write.message["num_held_blocks"] == [0] * len(pair.layers)
    assert_write(pair, write, 0)


def _drop_held(message: dict[str, Any]) -> None:
    message.pop("num_held_blocks", None)


def test_older_decoder_gets_every_page_and_one_warning(
    pair: WritePair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder that does not say what it holds (another build) gets every
    page from the first, into its position-indexed table, and the state; the
    prefiller says so once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_engine

    warnings: list[str] = []
    monkeypatch.setattr(
        moriio_engine.logger,
        "warning_once",
        lambda msg, *args, **kw: warnings.append(msg % args),
    )
    write = pair.write(prompt(3, 100), decode_hit_tokens=48, message=_drop_held)
    assert_write(pair, write, 0)
    assert len(warnings) == 1
    assert "writing every page" in warnings[0]


def test_full_hit_writes_nothing_and_releases(pair: WritePair) -> None:
    """Guard: the decoder holds the whole prompt but its last token (vLLM
    caps a hit at N - 1, the state included in align mode): it loads nothing,
    asks for no write and releases the prefiller's blocks."""
    legs = pair.legs
    tokens = prompt(4, 49)
    warm = [*tokens[:48], *prompt(20_500, 1)]
    legs._run_local(legs.decode, legs._request("warm-full", warm, None))
    params = write_params("t-full", do_remote_prefill=True)
    legs.decode.add_request(legs._request("req-full", tokens, params))
    pair.sent.clear()
    legs._finish_step(legs.decode, legs.decode.schedule())
    assert [m["type"] for m in pair.sent] == ["release"]
