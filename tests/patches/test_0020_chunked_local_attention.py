"""Patch 0020: READ serves chunked local attention groups (Llama 4).

A token of a ``ChunkedLocalAttentionSpec`` group attends to the positions of
its own chunk before it: the decoder's recomputed token N-1 needs positions
[C * ((N-1) // C), N-1) (C the chunk size), and vLLM's KV cache managers
free the pages below that chunk on both legs. The decoder now reads exactly
the pages of that chunk it lacks, paired by position with the prefiller's;
before, MoRIIO refused such a group at start. Both legs are real vLLM
schedulers with the MoRIIO connector, next to a full-attention group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.utils.math_utils import cdiv

from tests.patches.builders import (
    SchedulerPair,
    chunked_local_spec,
    full_attention_spec,
    kda_mamba_spec,
    make_leg_connector,
    pages_not_lacked,
    paired_pages,
    prompt,
    scheduler_pair_cache,
)

NULL_BLOCK = 0


def _groups(block_size: int, chunk: int) -> list[tuple[list[str], Any]]:
    return [
        (["model.layers.0.self_attn.attn"], chunked_local_spec(block_size, chunk)),
        (["model.layers.1.self_attn.attn"], full_attention_spec(block_size)),
    ]


@pytest.fixture(scope="module")
def scheduler_pairs(llama_model_dir: Path) -> Callable[[int, int], SchedulerPair]:
    return scheduler_pair_cache(llama_model_dir, _groups)


def _lengths(block_size: int, chunk: int) -> list[int]:
    """Every length up to three chunks and one page past them: each position
    of N-1 in its chunk and its page, N a multiple of the chunk and of the
    page included."""
    return list(range(1, 3 * chunk + block_size + 2))


@pytest.mark.parametrize("hit", [0.0, 0.5, 1.0], ids=["hit0", "hit50", "hit100"])
@pytest.mark.parametrize(
    ("block_size", "chunk"), [(16, 64), (32, 64)], ids=["b16-c64", "b32-c64"]
)
def test_chunk_pages_read_are_pages_lacked(
    scheduler_pairs: Callable[[int, int], SchedulerPair],
    block_size: int,
    chunk: int,
    hit: float,
) -> None:
    """Each group reads exactly the pages the decoder lacks, each from the
    prefiller's page of the same positions: the chunked group those of the
    chunk of N-1, the full-attention group every page before N-1. A hit of
    100 % is every whole page of the N-1 tokens before the recomputed one."""
    pair = scheduler_pairs(block_size, chunk)
    wrong = []
    for n in _lengths(block_size, chunk):
        hit_tokens = int((n - 1) * hit) // block_size * block_size
        seed = 1000 * (block_size // 16) + 3 * n + int(2 * hit)
        read = pair.read(prompt(seed, n), hit_tokens)
        assert read.decode_hit_tokens == hit_tokens, (n, read.decode_hit_tokens)
        assert read.num_prefilled_tokens == max(n - 1, 1)
        # The chunked group attends to the chunk of N-1, the full group to
        # every position.
        wrong += pages_not_lacked(read, block_size, ((n - 1) // chunk * chunk, 0))
    assert not wrong, f"{len(wrong)} wrong: {wrong[:4]}"


def test_prefiller_sends_the_chunk_of_the_recomputed_token(
    scheduler_pairs: Callable[[int, int], SchedulerPair],
) -> None:
    """N = 2C: the token N-1 closes the second chunk and attends to all of it
    but itself. The prefiller computed N-1 tokens, so vLLM kept that chunk's
    pages, and it sends them (a prefiller of N tokens would have freed them
    all); the decoder reads the chunk's C/B pages."""
    block_size, chunk = 16, 64
    pair = scheduler_pairs(block_size, chunk)
    n = 2 * chunk
    read = pair.read(prompt(5000, n), 0)
    assert read.num_prefilled_tokens == n - 1
    chunk_pages = list(range(chunk // block_size, n // block_size))
    assert paired_pages(read, 0) == chunk_pages
    assert all(read.prefill_tables[0][p] != NULL_BLOCK for p in chunk_pages)
    assert set(read.prefill_tables[0][: chunk // block_size]) == {NULL_BLOCK}


def test_freed_chunk_page_is_prefilled_locally(
    scheduler_pairs: Callable[[int, int], SchedulerPair],
    connector_warnings: list[logging.LogRecord],
) -> None:
    """A payload whose chunk page the decoder needs is the null block (a
    prefiller that freed it) is refused before allocation: that request is
    prefilled locally, logged, beside a request that READs its pages."""
    block_size, chunk = 16, 64
    pair = scheduler_pairs(block_size, chunk)
    n = chunk + 40
    i = next(pair.counter)
    ok, bad = f"ok-{i}", f"bad-{i}"
    tokens = {ok: prompt(6000 + 2 * i, n), bad: prompt(6001 + 2 * i, n)}
    params = {rid: pair.prefill_payload(rid, toks) for rid, toks in tokens.items()}
    chunk_list = params[bad]["remote_block_ids"][0]
    first = len(chunk_list) - (cdiv(n, block_size) - chunk // block_size)
    assert chunk_list[first] != NULL_BLOCK
    chunk_list[first] = NULL_BLOCK
    output = pair.schedule_beside_refused(ok, bad, tokens, params)
    pair._finish_step(pair.decode, output)
    while {ok, bad} & set(pair.decode.requests):
        pair._step(pair.decode)
    lines = [r.getMessage() for r in connector_warnings if bad in r.getMessage()]
    assert len(lines) == 1 and "served by local prefill" in lines[0]
    pair._step(pair.prefill, finished_sending={ok, bad})


def test_write_refuses_chunked_groups_at_start(llama_model_dir: Path) -> None:
    """WRITE would push a chunk the prefiller already freed: refused at start
    in one line naming the spec. Beside a state group and under DCP 2: the
    series later serves WRITE chunked groups under DCP 1."""
    groups = [*_groups(16, 64), (["model.layers.2.linear_attn"], kda_mamba_spec(16))]
    with pytest.raises(NotImplementedError, match="WRITE mode does not support"):
        make_leg_connector(
            llama_model_dir, "kv_producer", groups, read_mode=False, dcp=2
        )
