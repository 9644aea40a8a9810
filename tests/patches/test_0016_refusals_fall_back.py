"""Patch 0016: a READ the decoder refuses serves that request without its
transfer instead of failing the engine.

vLLM's ``Scheduler.schedule()`` calls the connector's
``get_num_new_matched_tokens`` and ``update_state_after_alloc`` with no error
handling: a ``MoRIIOError`` raised there for one request's payload ends every
request in flight. The decoder now checks the payload before allocation and
answers a refusal with no external token (vLLM prefills the request locally)
and a release of the prefiller's blocks; a refusal after allocation reads
nothing and, with one KV cache group, hands the request's external blocks to
vLLM's KV load failure path. Each one is logged and counted
(``num_fallbacks``).

The first tests run a real prefill scheduler and a real decode scheduler
(``Scheduler`` with the MoRIIO connector) with two requests on the decoder
in one step, one
of them carrying a faulty payload.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import KVConnectorOutput

from tests.patches.builders import (
    Group,
    SchedulerPair,
    build_scheduler_pair,
    connector,
    decode_tables,
    finish_prefill,
    full_attention_spec,
    make_kv_cache_blocks,
    make_request,
    next_request_id,
    prompt,
    sliding_window_spec,
)
from tests.patches.vllm_unit_utils import create_model_runner_output

B, W, N = 16, 64, 95
"""The decoder's window reads positions [N-W, N-1): pages 1..5."""


def _groups() -> list[tuple[list[str], Any]]:
    return [
        (["model.layers.0.self_attn.attn"], full_attention_spec(B)),
        (["model.layers.1.self_attn.attn"], sliding_window_spec(B, W)),
    ]


def _drop_last_group(lists: list[list[int]]) -> list[list[int]]:
    return lists[:-1]


def _halve_full_group(lists: list[list[int]]) -> list[list[int]]:
    return [lists[0][: len(lists[0]) // 2], lists[1]]


def _null_window_start(lists: list[list[int]]) -> list[list[int]]:
    return [lists[0], [0, *lists[1][1:]]]


FAULTS: dict[str, Callable[[list[list[int]]], list[list[int]]]] = {
    "group_count": _drop_last_group,
    "short_table": _halve_full_group,
    "null_window": _null_window_start,
}


@pytest.fixture(scope="module")
def pair(llama_model_dir: Path) -> SchedulerPair:
    return build_scheduler_pair(llama_model_dir, _groups(), B)


class _Counted:
    """The decode connector's stats as the scheduler drains them."""

    def __init__(self, pair: SchedulerPair) -> None:
        self.fallbacks = 0
        conn = pair.decode.connector
        assert conn is not None
        take = conn.get_kv_connector_stats

        def spy() -> Any:
            stats = take()
            if stats is not None:
                self.fallbacks += stats.data.get("num_fallbacks", 0)
            return stats

        conn.get_kv_connector_stats = spy  # type: ignore[method-assign]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_refused_payload_is_prefilled_locally_beside_a_transfer(
    pair: SchedulerPair, fault: str, connector_warnings: list[logging.LogRecord]
) -> None:
    """The decoder's step returns; the intact request READs its pages and
    completes, the refused one has no external token, reads nothing (its
    prefiller is only released) and completes by local prefill."""
    i = next(pair.counter)
    ok, bad = f"ok-{i}", f"bad-{i}"
    tokens = {ok: prompt(2 * i + 1, N), bad: prompt(2 * i + 2, N)}
    params = {rid: pair.prefill_payload(rid, toks) for rid, toks in tokens.items()}
    params[bad]["remote_block_ids"] = FAULTS[fault](params[bad]["remote_block_ids"])
    counted = _Counted(pair)
    output = pair.schedule_beside_refused(ok, bad, tokens, params)
    meta = output.kv_connector_metadata.reqs_to_recv
    assert meta[bad].remote_block_ids == [[], []]
    finished = set()
    for out in pair._finish_step(pair.decode, output):
        if out.finish_reason is not None:
            finished.add(out.request_id)
    while {ok, bad} & set(pair.decode.requests):
        finished |= {o.request_id for o in pair._step(pair.decode) if o.finish_reason}
    assert finished == {ok, bad}
    assert counted.fallbacks == 1
    lines = [r.getMessage() for r in connector_warnings if bad in r.getMessage()]
    assert len(lines) == 1 and "served by local prefill" in lines[0]
    pair._step(pair.prefill, finished_sending={ok, bad})


def test_payload_without_a_prefiller_address_is_prefilled_locally(
    pair: SchedulerPair,
) -> None:
    """A payload the workers could not route (no address in the request id
    nor in kv_transfer_params) used to raise in build_connector_meta, inside
    schedule(); it is now refused before allocation and prefilled locally."""
    i = next(pair.counter)
    ok, bad = f"ok-{i}", f"bad-{i}"
    tokens = {ok: prompt(2 * i + 1, N), bad: prompt(2 * i + 2, N)}
    params = {rid: pair.prefill_payload(rid, toks) for rid, toks in tokens.items()}
    for key in ("remote_host", "remote_handshake_port", "remote_notify_port"):
        params[bad].pop(key)
    counted = _Counted(pair)
    for rid in (ok, bad):
        pair.decode.add_request(pair._request(rid, tokens[rid], params[rid]))
    output = pair.decode.schedule()
    # ``ok`` loads (asynchronously: computed once loaded), ``bad`` is prefilled.
    assert output.num_scheduled_tokens.get(ok, 1) == 1
    assert output.num_scheduled_tokens[bad] == N
    assert bad not in output.kv_connector_metadata.reqs_to_recv
    pair._finish_step(pair.decode, output)
    while {ok, bad} & set(pair.decode.requests):
        pair._step(pair.decode)
    assert counted.fallbacks == 1
    pair._step(pair.prefill, finished_sending={ok, bad})


def test_refusal_after_allocation_with_several_groups_is_released_and_counted(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal after allocation on a hybrid model (several KV cache groups,
    no load-failure path in vLLM 0.34.0) no longer leaves the hook: nothing
    is read, the prefiller is released, the fallback counted."""
    num_prompt_tokens, hit_tokens = 128 * 8 + 7, 128 * 2
    groups = [Group("target", 128), Group("kda")]
    request_id = next_request_id()
    params = finish_prefill(llama_model_dir, groups, 1, request_id, num_prompt_tokens)
    consumer = connector(llama_model_dir, groups, 1, "kv_consumer")
    scheduler = consumer.connector_scheduler
    assert scheduler is not None
    decode = make_request(request_id, num_prompt_tokens, params)
    external, _ = consumer.get_num_new_matched_tokens(decode, hit_tokens)
    assert external == num_prompt_tokens - 1 - hit_tokens
    _refuse_for(scheduler, request_id, monkeypatch)
    tables = decode_tables(groups, num_prompt_tokens + 1, 1)
    consumer.update_state_after_alloc(decode, make_kv_cache_blocks(tables), external)
    _, local = scheduler._reqs_need_recv[request_id]
    assert local == [[], []]
    assert decode.kv_transfer_params["do_remote_prefill"] is False
    if request_id in scheduler._reqs_load_failed:
        # An asynchronous load: the workers report it failed.
        consumer.update_connector_output(
            KVConnectorOutput(
                finished_recving={request_id}, failed_recving={request_id}
            )
        )
    stats = consumer.get_kv_connector_stats()
    assert stats is not None and stats.reduce() == {"num_fallbacks": 1}
    assert consumer.get_kv_connector_stats() is None


def _refuse_for(scheduler: Any, request_id: str, monkeypatch: Any) -> None:
    """A refusal after allocation for ``request_id`` alone (the pairing of its
    full-attention pages raises)."""
    select = scheduler._select_missing_attention_pages

    def refuse(request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.request_id == request_id:
            raise moriio_connector.MoRIIOError("injected refusal")
        return select(request, *args, **kwargs)

    monkeypatch.setattr(scheduler, "_select_missing_attention_pages", refuse)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_refusal_after_allocation_with_one_group_is_a_load_error(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """One KV cache group: the refused request's blocks reach the workers as
    KV load errors, and vLLM's real scheduler recomputes the request (or
    fails it alone, by kv_load_failure_policy) while the other completes."""
    pair = build_scheduler_pair(
        llama_model_dir,
        [(["model.layers.0.self_attn.attn"], full_attention_spec(B))],
        B,
    )
    pair.decode.recompute_kv_load_failures = policy == "recompute"
    ok, bad = "ok", "bad"
    tokens = {ok: prompt(1, N), bad: prompt(2, N)}
    params = {rid: pair.prefill_payload(rid, toks) for rid, toks in tokens.items()}
    conn = pair.decode.connector
    assert conn is not None
    _refuse_for(conn.connector_scheduler, bad, monkeypatch)
    counted = _Counted(pair)
    for rid in (ok, bad):
        pair.decode.add_request(pair._request(rid, tokens[rid], params[rid]))

    output = pair.decode.schedule()
    meta = output.kv_connector_metadata
    table = pair.decode.kv_cache_manager.get_block_ids(bad)[0]
    assert meta.reqs_load_failed == {bad: list(table)}
    assert meta.reqs_to_recv[bad].local_block_ids == [[]]
    assert all(meta.reqs_to_recv[ok].local_block_ids)
    reqs = [pair.decode.requests[r] for r in output.num_scheduled_tokens]
    if bad in output.num_scheduled_tokens:
        # A synchronous load: the workers report its blocks as load errors.
        runner = create_model_runner_output(
            reqs, invalid_block_ids=set(meta.reqs_load_failed[bad]), token_id=7
        )
    else:
        # An asynchronous one: they report it failed (and received).
        runner = create_model_runner_output(
            reqs, finished_recving={ok, bad}, token_id=7
        )
        assert runner.kv_connector_output is not None
        runner.kv_connector_output.failed_recving = {bad}
    result = pair.decode.update_from_output(output, runner)
    outputs = [o for eco in result.values() for o in eco.outputs]
    scheduled_bad = []
    for _ in range(4):
        if not {ok, bad} & set(pair.decode.requests):
            break
        again = pair.decode.schedule()
        scheduled_bad.append(again.num_scheduled_tokens.get(bad))
        outputs += pair._finish_step(pair.decode, again)
    finished = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert finished[ok] != FinishReason.ERROR
    if policy == "fail":
        assert finished[bad] == FinishReason.ERROR
    else:
        assert finished[bad] != FinishReason.ERROR
        assert N in scheduled_bad
    assert not {ok, bad} & set(pair.decode.requests)
    assert counted.fallbacks == 1
    pair._step(pair.prefill, finished_sending={ok, bad})


def test_stats_aggregate_and_reduce() -> None:
    build = moriio_connector.MoRIIOConnector.build_kv_connector_stats
    a, b = build({"num_fallbacks": 2}), build({"num_fallbacks": 3})
    assert a is not None and b is not None
    assert a.aggregate(b).reduce() == {"num_fallbacks": 5}
    empty = build()
    assert empty is not None and empty.is_empty()
    assert not a.is_empty()
