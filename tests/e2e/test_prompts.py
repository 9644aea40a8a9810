"""Prompt construction hits exact token lengths with a real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.e2e.tokenizer import build_tokenizer
from vllm_overlay.e2e.config import ConfigError
from vllm_overlay.e2e.prompts import (
    REQUIRED_LENGTHS,
    kv_prompt,
    load_tokenizer,
    needle_prompt,
    sweep_lengths,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    return load_tokenizer(path)


def test_sweep_covers_required_lengths_and_every_boundary() -> None:
    lengths = sweep_lengths([16, 64], max_len=1024)
    assert len(lengths) >= 100
    assert set(REQUIRED_LENGTHS) <= set(lengths)
    for b in (16, 64):
        for k in range(1, 1024 // b + 1):
            near = {k * b - 1, k * b, k * b + 1, k * b + 2}
            assert {n for n in near if n <= 1024} <= set(lengths), (b, k)
    assert lengths == sorted(set(lengths))
    assert max(lengths) <= 1024


def test_sweep_tops_up_to_the_minimum_count() -> None:
    # One boundary only: the even spacing must fill up to 100 lengths.
    lengths = sweep_lengths([512], max_len=1024, required=())
    assert len(lengths) >= 100
    assert {511, 512, 513, 514, 1023, 1024} <= set(lengths)


def test_every_sweep_prompt_has_its_exact_length(tok: Tokenizer) -> None:
    lengths = sweep_lengths([16], max_len=1024)
    assert len(lengths) >= 100
    for n in lengths:
        p = kv_prompt(tok, n)
        assert p.length == n, (n, p.length)
        assert p.token_ids[0] == tok.token_to_id("<s>")


@pytest.mark.parametrize("n", REQUIRED_LENGTHS)
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
