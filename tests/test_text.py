"""Counts in printed text: one of a thing is singular."""

from __future__ import annotations

import pytest

from vllm_overlay.text import count, verb


@pytest.mark.parametrize(
    ("n", "words", "said"),
    [
        (0, ("test",), "0 tests"),
        (1, ("test",), "1 test"),
        (2, ("guard",), "2 guards"),
        (1, ("patch", "patches"), "1 patch"),
        (14, ("patch", "patches"), "14 patches"),
    ],
)
def test_count(n: int, words: tuple[str, ...], said: str) -> None:
    assert count(n, *words) == said


def test_verb() -> None:
    assert [verb(n, "fails", "fail") for n in (0, 1, 2)] == ["fail", "fails", "fail"]
