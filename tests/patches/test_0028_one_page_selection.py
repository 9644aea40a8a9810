"""Patch 0028: one page selection for hybrid and non-hybrid transfers.

The decoder's scheduler selects, per KV cache group, the pages it lacks and
the prefill pages that pair with them in one place
(``MoRIIOConnectorScheduler._select_group_pages``): READ with and without a
state group, and WRITE's count of the pages the decoder holds. A refactor:
what each path selects is unchanged (the earlier patches' tests pin that);
these tests pin that every path goes through the one selection and uses its
result, and that ``update_state_after_alloc`` stays near its base size.

Both legs are real vLLM ``Scheduler``s with the MoRIIO connector; a spy on
the scheduler class wraps the selection and records what it returned.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheSpec

from tests.patches.builders import (
    SchedulerPair,
    WritePair,
    build_scheduler_pair,
    full_and_window_groups,
    full_attention_spec,
    mla_spec,
    page_kda_spec,
    prompt,
    write_pair_fixture,
)

B, W = 16, 64
MAX_LINES = 330
"""``update_state_after_alloc``'s size limit (the pinned base's is 297)."""
# A page every state fits in: 16 tokens x 2 KV heads x 64 x bf16 x K, V.
PAGE = full_attention_spec(B).page_size_bytes
SCHEDULER = moriio_connector.MoRIIOConnectorScheduler


def hybrid_groups() -> list[tuple[list[str], KVCacheSpec]]:
    """Full attention, a window group and a recurrent-state group."""
    return [
        *full_and_window_groups(B, W),
        (["model.layers.2.linear_attn"], page_kda_spec(B)),
    ]


def kimi_like() -> list[tuple[list[str], KVCacheSpec]]:
    """One MLA group and one KDA state group."""
    return [
        (["model.layers.1.self_attn.attn"], mla_spec(B, page_size_padded=PAGE)),
        (["model.layers.0.linear_attn"], page_kda_spec(B)),
    ]


READ_LAYOUTS: dict[str, Callable[[], list[tuple[list[str], KVCacheSpec]]]] = {
    "non_hybrid": lambda: full_and_window_groups(B, W),
    "hybrid": hybrid_groups,
}
WRITE_LAYOUTS: dict[str, Callable[[], list[tuple[list[str], KVCacheSpec]]]] = {
    "non_hybrid": lambda: [(["model.layers.0.self_attn.attn"], full_attention_spec(B))],
    "hybrid": kimi_like,
}


Call = tuple[int, int, tuple[int, list[int], list[int]]]
"""(transfer group, held tokens, what the selection returned)."""


@pytest.fixture
def selections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Call]]:
    """Every call of the scheduler's one page selection. Below the patch the
    scheduler has none, so nothing is recorded."""
    calls: list[Call] = []
    select = getattr(SCHEDULER, "_select_group_pages", None)

    def spy(self: Any, request: Any, group_id: int, num_held: int, *a: Any) -> Any:
        assert select is not None
        result = select(self, request, group_id, num_held, *a)
        calls.append((group_id, num_held, result))
        return result

    monkeypatch.setattr(SCHEDULER, "_select_group_pages", spy, raising=False)
    yield calls


@pytest.fixture(scope="module", params=list(READ_LAYOUTS))
def read_pair(request: pytest.FixtureRequest, llama_model_dir: Path) -> SchedulerPair:
    return build_scheduler_pair(llama_model_dir, READ_LAYOUTS[request.param](), B)


@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens"),
    [(100, 0), (100, 48), (530, 128)],
    ids=["no_hit", "hit", "long"],
)
def test_read_selects_every_attention_group_through_the_one_selection(
    read_pair: SchedulerPair,
    selections: list[Call],
    num_tokens: int,
    hit_tokens: int,
) -> None:
    """With and without a state group, READ pairs each attention group's
    pages by the one selection, in payload order, and reads what it
    returned; the full-attention group reads the pages past the hit."""
    read = read_pair.read(prompt(num_tokens + hit_tokens, num_tokens), hit_tokens)
    num_attn = 2
    assert [group for group, _, _ in selections] == list(range(num_attn))
    held = read.decode_hit_tokens
    assert all(num_held == held for _, num_held, _ in selections)
    assert read.local_block_ids[:num_attn] == [
        local for _, _, (_, local, _) in selections
    ]
    assert read.remote_block_ids[:num_attn] == [
        remote for _, _, (_, _, remote) in selections
    ]
    pages = range(held // B, cdiv(num_tokens - 1, B))
    assert read.local_block_ids[0] == [read.decode_tables[0][k] for k in pages]
    assert read.remote_block_ids[0] == [read.prefill_tables[0][k] for k in pages]


write_pair = write_pair_fixture(WRITE_LAYOUTS, B)


@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens"), [(100, 48), (66, 0)], ids=["hit", "no_hit"]
)
def test_write_counts_held_pages_through_the_one_selection(
    write_pair: WritePair,
    selections: list[Call],
    num_tokens: int,
    hit_tokens: int,
) -> None:
    """With and without a state group, the WRITE decoder's count of the
    pages it holds per group is the one selection's, and the prefiller
    writes each attention page from there."""
    write = write_pair.write(prompt(3 + hit_tokens, num_tokens), hit_tokens)
    held = write.message["num_held_blocks"]
    assert [group for group, _, _ in selections] == list(range(len(held)))
    assert held == [num_held_pages for _, _, (num_held_pages, _, _) in selections]
    assert held[0] == hit_tokens // B
    last = cdiv(num_tokens - 1, B)
    assert write.group_pairs[0] == [
        (write.prefill_tables[0][k], write.decode_tables[0][k])
        for k in range(hit_tokens // B, last)
    ]


def test_update_state_after_alloc_stays_near_its_base_size() -> None:
    """The scheduler hook the series grows is at most 330 lines (ast, on
    the loaded connector's source)."""
    source = textwrap.dedent(inspect.getsource(SCHEDULER.update_state_after_alloc))
    (function,) = ast.parse(source).body
    assert isinstance(function, ast.FunctionDef)
    assert function.end_lineno is not None
    num_lines = function.end_lineno - function.lineno + 1
    assert num_lines <= MAX_LINES, (
        f"update_state_after_alloc is {num_lines} lines (at most {MAX_LINES})"
    )
