"""A WRITE prefiller with a window group keeps the window of the token the
decoder recomputes.

The decoder recomputes the last prompt token, position N-1, whose window
reads positions [N-W, N-1). When a prefill of N tokens finishes, vLLM's
scheduler frees every window block below the window of token N (positions
below N-W+1) while the prefiller's push of them may still be in flight:
whenever N-W is the last slot of its block, the prefiller's table holds the
null block at the decoder's window start, and the write fails (the decoder
recomputes the request). The prefiller computes N-1 tokens when the model
has a window group, so its scheduler keeps that block.

Both legs are real vLLM ``Scheduler``s with prefix caching; the prefiller's
pairs come from its real message handling and write task.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.utils.math_utils import cdiv

from tests.patches.builders import assert_window_written, prompt, window_write_pair


# N % B == B - 1 puts N - W at the last slot of its page (the window start):
# Gemma-like (B 16, W 512) and DeepSeek-V4-like (B 64, W 128) models whose
# layers all use one window (one window group without the hybrid manager).
@pytest.mark.parametrize(
    ("block_size", "window", "num_tokens"),
    [(16, 512, 527), (16, 512, 1039), (64, 128, 191)],
    ids=["b16-w512-527", "b16-w512-1039", "b64-w128-191"],
)
def test_all_window_model_writes_the_window_start(
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    block_size: int,
    window: int,
    num_tokens: int,
) -> None:
    """The prefiller writes the page of N - W from its own block, never the
    null block, into the decoder's page of the same positions."""
    pair = window_write_pair(llama_model_dir, monkeypatch, block_size, window, False)
    write = pair.write(prompt(1, num_tokens))
    assert_window_written(write, block_size, [window])
    first = (num_tokens - window) // block_size
    assert write.prefill_tables[0][first] != 0
    assert 0 not in write.decode_tables[0][first : cdiv(num_tokens - 1, block_size)]


@pytest.mark.parametrize("num_tokens", [527, 543])
def test_full_and_window_groups_write_the_window_start(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch, num_tokens: int
) -> None:
    """With the hybrid manager too: the full-attention group gets the pages
    it lacks, [0, N - 1); the window group [N - W, N - 1), its first page
    included."""
    pair = window_write_pair(llama_model_dir, monkeypatch, 16, 512, True)
    write = pair.write(prompt(2, num_tokens))
    assert_window_written(write, 16, [None, 512])
    assert write.prefill_tables[1][(num_tokens - 512) // 16] != 0
