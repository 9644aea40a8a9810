"""Patch 0017: the READ prefiller states the prompt tokens it computed.

A READ prefiller computes N - 1 tokens when the model has a window group, and
the decoder used to infer that from its own build. A prefiller that computes
all N tokens (vLLM's MoRIIO without a state group) then had its window pages
paired one block off, or its freed window start read. The payload now
carries ``moriio_protocol`` and ``prefilled_tokens``; the decoder pairs by
them, pairs a payload without them as such a prefiller computes (N tokens
without a state group), and prefills locally a request whose statement it
cannot use.

A real prefill scheduler and a real decode scheduler (each a ``Scheduler``
with the MoRIIO connector) run each prompt; the prefiller of another build
is the same prefiller made to compute all N tokens, its payload without the
statement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

from tests.patches.builders import (
    SchedulerPair,
    build_scheduler_pair,
    full_attention_spec,
    prompt,
    sliding_window_spec,
)

B, W = 16, 64
STATEMENT = ("moriio_protocol", "prefilled_tokens")


def _groups(window: bool) -> list[tuple[list[str], Any]]:
    groups = [(["model.layers.0.self_attn.attn"], full_attention_spec(B))]
    if window:
        groups.append((["model.layers.1.self_attn.attn"], sliding_window_spec(B, W)))
    return groups


@pytest.fixture(scope="module")
def gemma_pair(llama_model_dir: Path) -> SchedulerPair:
    return build_scheduler_pair(llama_model_dir, _groups(True), B)


def _decode(pair: SchedulerPair, request_id: str, tokens: list[int], params: Any):
    """Admit on the decode leg; its first step's READ and tables."""
    pair.decode.add_request(pair._request(request_id, tokens, params))
    output = pair.decode.schedule()
    tables = [list(t) for t in pair.decode.kv_cache_manager.get_block_ids(request_id)]
    meta = output.kv_connector_metadata.reqs_to_recv[request_id]
    for _ in range(4):
        if request_id in output.num_scheduled_tokens:
            break
        # An asynchronous load: the request is computed once it landed.
        pair._finish_step(pair.decode, output)
        output = pair.decode.schedule()
    scheduled = output.num_scheduled_tokens[request_id]
    pair._finish_step(pair.decode, output)
    while request_id in pair.decode.requests:
        pair._step(pair.decode)
    pair._step(pair.prefill, finished_sending={request_id})
    return meta, tables, scheduled


def _pairing_errors(
    n: int, p_tables: list[list[int]], d_tables: list[list[int]], meta: Any
) -> list[str]:
    """A READ pair that is not positional or holds a null block, or a page the
    decoder's last token needs that it neither READs nor computes."""
    errors = []
    for g, window in enumerate((None, W)):
        pairs = list(
            zip(meta.local_block_ids[g], meta.remote_block_ids[g], strict=True)
        )
        for d_block, p_block in pairs:
            if 0 in (d_block, p_block):
                errors.append(f"group {g}: {d_block} <- {p_block} is null")
            elif d_tables[g].index(d_block) != p_tables[g].index(p_block):
                errors.append(
                    f"group {g}: decode page {d_tables[g].index(d_block)} <- "
                    f"prefill page {p_tables[g].index(p_block)}"
                )
        first = 0 if window is None else max(n - window, 0) // B
        read = {d_tables[g].index(d) for d, _ in pairs}
        missing = [k for k in range(first, -(-(n - 1) // B)) if k not in read]
        if missing:
            errors.append(f"group {g}: pages {missing} not read")
    return errors


@pytest.mark.parametrize(
    ("window", "dropped"), [(True, 1), (False, 0)], ids=["window", "full"]
)
def test_prefiller_states_what_it_computed(
    llama_model_dir: Path, window: bool, dropped: int
) -> None:
    pair = build_scheduler_pair(llama_model_dir, _groups(window), B)
    n = 95
    params, _, computed = pair.prefill_run("stated", prompt(1, n))
    assert computed == n - dropped
    assert params["moriio_protocol"] == moriio_connector.MORIIO_PROTOCOL_VERSION
    assert params["prefilled_tokens"] == n - dropped
    pair._step(pair.prefill, finished_sending={"stated"})


@pytest.mark.parametrize("n", range(W + 1, W + 1 + 2 * B))
def test_prefiller_without_the_statement_is_paired_by_what_it_sent(
    gemma_pair: SchedulerPair, n: int
) -> None:
    """A prefiller that computes all N tokens and states nothing: the decoder
    READs each window page from the page holding the same positions, or,
    where that prefiller freed the window start, prefills the request
    locally (no READ, the whole prompt scheduled)."""
    pair = gemma_pair
    i = next(pair.counter)
    conn = pair.prefill.connector
    assert conn is not None and conn.connector_scheduler is not None
    conn.connector_scheduler._prefill_drops_last_token = False
    try:
        params, p_tables, computed = pair.prefill_run(f"old-{i}", prompt(i + 1, n))
    finally:
        conn.connector_scheduler._prefill_drops_last_token = True
    assert computed == n
    for key in STATEMENT:
        params.pop(key, None)
    meta, d_tables, scheduled = _decode(pair, f"old-{i}", prompt(i + 1, n), params)
    if not any(meta.local_block_ids):
        freed = (n - W) // B
        assert scheduled == n and p_tables[1][freed] == 0
        return
    assert scheduled == 1
    assert _pairing_errors(n, p_tables, d_tables, meta) == []


@pytest.mark.parametrize(
    "statement",
    [{"prefilled_tokens": 92}, {"moriio_protocol": "one"}, {"prefilled_tokens": None}],
    ids=["count", "protocol", "no_count"],
)
def test_unusable_statement_is_prefilled_locally(
    gemma_pair: SchedulerPair, statement: dict[str, Any]
) -> None:
    pair = gemma_pair
    i = next(pair.counter)
    n = 95
    params, _, _ = pair.prefill_run(f"bad-{i}", prompt(i + 1, n))
    params.update(statement)
    meta, _, scheduled = _decode(pair, f"bad-{i}", prompt(i + 1, n), params)
    assert scheduled == n
    assert meta.local_block_ids == [[], []]
