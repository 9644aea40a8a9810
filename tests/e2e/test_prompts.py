"""Prompt construction hits exact token lengths with a real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.e2e.conftest import EXAMPLES
from tests.e2e.tokenizer import build_tokenizer
from vllm_overlay.e2e.config import ConfigError, load_config
from vllm_overlay.e2e.prompts import (
    kv_prompt,
    load_tokenizer,
    needle_prompt,
    prefix_pair,
)
from vllm_overlay.e2e.runner import planned_lengths

SEED_LENGTHS = (251, 377, 384, 440, 447, 636, 832, 895)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    return load_tokenizer(path)


def test_every_sweep_prompt_has_its_exact_length(tok: Tokenizer) -> None:
    config = load_config(EXAMPLES / "dsv4-pro-1p1d.toml")
    lengths = planned_lengths(config)
    assert len(lengths) >= 100
    for n in lengths:
        p = kv_prompt(tok, n)
        assert p.length == n, (n, p.length)
        assert p.token_ids[0] == tok.token_to_id("<s>")


@pytest.mark.parametrize("n", SEED_LENGTHS)
def test_kv_prompt_asks_for_a_key_it_lists(tok: Tokenizer, n: int) -> None:
    p = kv_prompt(tok, n)
    text = tok.decode(p.token_ids)
    assert p.kind == "kv"
    key = text.rsplit("What is the value of key ", 1)[1].split("?")[0]
    assert f"key {key}: value {p.expected}\n" in text
    assert text.count(f"key {key}:") == 1
    assert text.endswith("The value is")
    assert kv_prompt(tok, n).token_ids == p.token_ids  # deterministic


def test_short_lengths_fall_back_to_plain_prompts(tok: Tokenizer) -> None:
    for n in (2, 15, 16, 17):
        p = kv_prompt(tok, n)
        assert p.length == n
        assert p.kind == "plain"


@pytest.mark.parametrize("words", [2000, 8000, 32000, 96000])
def test_needle_prompt_word_count_and_needle(tok: Tokenizer, words: int) -> None:
    p = needle_prompt(tok, words)
    text = tok.decode(p.token_ids)
    body, question = text.rsplit("\n", 1)
    needle = f"The special magic number is {p.expected}."
    assert body.count(needle) == 1
    assert len(body.replace(needle, "").split()) == words
    assert question.startswith("What is the special magic number")
    # Encoding is not compositional, so the length is the tokenizer's.
    assert p.length == len(tok.encode(text).ids)


def test_a_missing_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.tokenizer .*: cannot load"):
        load_tokenizer(tmp_path / "nope.json")


@pytest.mark.parametrize("fraction", [0.5, 0.897])
def test_prefix_pair_shares_exactly_its_fraction(
    tok: Tokenizer, fraction: float
) -> None:
    first, second = prefix_pair(tok, 1000, fraction)
    assert first.length == second.length == 1000
    shared = int(1000 * fraction)
    assert first.token_ids[:shared] == second.token_ids[:shared]
    assert first.token_ids[shared:] != second.token_ids[shared:]
    assert tok.decode(second.token_ids).endswith("The value is")
