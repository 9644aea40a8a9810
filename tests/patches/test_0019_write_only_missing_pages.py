"""Patch 0019: WRITE (full attention, no state group) writes the pages the
decoder lacks and no other: positions [L, N - 1) page by page, L the
decoder's local prefix hit.

Both legs are real vLLM ``Scheduler``s with prefix caching; the prefiller's
pairs come from its real message handling and write planner. Block size 16;
a decoder hit is made by running a prompt sharing the prefix on the decode
leg first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.utils.math_utils import cdiv

from tests.patches.builders import (
    LAYER,
    Write,
    WritePair,
    build_write_pair,
    full_attention_spec,
    prompt,
)

B = 16


@pytest.fixture
def pair(llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> WritePair:
    return build_write_pair(
        llama_model_dir, [([LAYER], full_attention_spec(B))], B, monkeypatch
    )


def needed_pairs(write: Write, first_page: int) -> list[tuple[int, int]]:
    """P's page k paired with D's page k for every page from ``first_page``
    holding a position below N - 1."""
    last = cdiv(write.num_prompt_tokens - 1, B)
    return [
        (write.prefill_table[k], write.decode_table[k]) for k in range(first_page, last)
    ]


@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens"),
    [(100, 48), (65, 32), (33, 16), (64, 48)],
    ids=["partial", "last_page_alone", "one_page_held", "aligned_prompt"],
)
def test_prefiller_writes_only_pages_the_decoder_lacks(
    pair: WritePair, num_tokens: int, hit_tokens: int
) -> None:
    write = pair.write(prompt(1, num_tokens), decode_hit_tokens=hit_tokens)
    assert write.pairs == needed_pairs(write, hit_tokens // B)
    assert write.message["num_held_blocks"] == [hit_tokens // B]


@pytest.mark.parametrize("num_tokens", [17, 65, 129])
def test_without_a_hit_no_page_past_the_decoders_need(
    pair: WritePair, num_tokens: int
) -> None:
    """N = 1 mod B: the page of position N - 1 alone is the decoder's to
    compute; the prefiller does not write it."""
    write = pair.write(prompt(2, num_tokens))
    assert write.pairs == needed_pairs(write, 0)


def test_full_hit_writes_nothing(pair: WritePair) -> None:
    """The decoder holds every position below N - 1 (vLLM caps a hit at
    N - 1): the prefiller plans no page (the writer posts nothing for an
    empty plan and still reports the transfer done)."""
    write = pair.write(prompt(3, 49), decode_hit_tokens=48)
    assert write.pairs == []
    assert write.message["num_held_blocks"] == [3]


def _drop_held(message: dict[str, Any]) -> None:
    message.pop("num_held_blocks", None)


def _bad_held(message: dict[str, Any]) -> None:
    message["num_held_blocks"] = [10_000]


@pytest.mark.parametrize(
    "edit", [_drop_held, _bad_held], ids=["decoder_without_counts", "bad_counts"]
)
def test_without_usable_counts_every_needed_page_from_the_first(
    pair: WritePair, edit: Any
) -> None:
    """A decoder that does not say what it holds (another build), or says it
    wrongly, gets every page from the first: its table is position-indexed,
    so rewriting a held page writes the bytes it holds."""
    write = pair.write(prompt(4, 100), decode_hit_tokens=48, message=edit)
    assert write.pairs == needed_pairs(write, 0)


def test_prefiller_pairs_an_older_decoders_table_by_position(pair: WritePair) -> None:
    """Guard: a decoder's message without counts, N != 1 mod B, no hit: every
    page of the prompt, P's page k to D's page k (the same before and with
    the patch)."""
    write = pair.write(prompt(5, 64), message=_drop_held)
    assert write.pairs == needed_pairs(write, 0)
