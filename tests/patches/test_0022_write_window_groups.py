"""Patch 0022: WRITE serves sliding-window groups: the prefiller writes the
pages of the decoder's window, positions [N - W, N - 1), page by page into
the same positions, skipping those the decoder holds, never a null block.

Both legs are real vLLM ``Scheduler``s with prefix caching; the prefiller's
pairs come from its real message handling and write task. The prefiller's
tables are those it holds once its prefill finished, while the write is in
flight: a page it writes must still be its own then.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import msgpack
import pytest
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tests.patches.builders import (
    LAYER,
    _Event,
    _role,
    _Worker,
    assert_window_written,
    full_attention_spec,
    kda_mamba_spec,
    make_kv_cache_config,
    make_scheduler_connector,
    make_vllm_config,
    model_runner_output,
    moriio_kv_transfer_config,
    prompt,
    record_notices,
    sliding_window_spec,
    window_write_pair,
    write_params,
)

NULL = 0


# Gemma-like (B 16, W 512) and DeepSeek-V4-like (B 64, W 128) models whose
# layers all use one window: one window group without the hybrid manager.
# (Lengths whose N - W ends its page: test_0051.)
@pytest.mark.parametrize(
    ("block_size", "window", "num_tokens"),
    [
        (16, 512, 100),
        (16, 512, 529),
        (64, 128, 300),
        (64, 128, 1000),
    ],
    ids=["b16-w512-100", "b16-w512-529", "b64-w128-300", "b64-w128-1000"],
)
def test_all_window_model_writes_the_decoders_window(
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    block_size: int,
    window: int,
    num_tokens: int,
) -> None:
    pair = window_write_pair(llama_model_dir, monkeypatch, block_size, window, False)
    write = pair.write(prompt(1, num_tokens))
    assert_window_written(write, block_size, [window])
    # The decoder counts N - 1 tokens external: its table keeps N - W.
    first = max(num_tokens - window, 0) // block_size
    assert NULL not in write.decode_tables[0][first : cdiv(num_tokens - 1, block_size)]


@pytest.mark.parametrize("num_tokens", [100, 529, 700])
def test_full_and_window_groups_with_hma(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch, num_tokens: int
) -> None:
    """The full-attention group gets the pages it lacks, [0, N - 1); the window
    group gets [N - W, N - 1)."""
    pair = window_write_pair(llama_model_dir, monkeypatch, 16, 512, True)
    write = pair.write(prompt(2, num_tokens))
    assert_window_written(write, 16, [None, 512])


@pytest.mark.parametrize(
    ("with_full", "num_tokens", "hit_tokens"),
    [(False, 700, 320), (False, 700, 96), (True, 700, 320), (True, 543, 528)],
    ids=["window-hit_past_start", "window-hit_below_start", "hma-hit", "hma-hit_528"],
)
def test_decoder_prefix_hit_is_not_rewritten(
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    with_full: bool,
    num_tokens: int,
    hit_tokens: int,
) -> None:
    pair = window_write_pair(llama_model_dir, monkeypatch, 16, 512, with_full)
    write = pair.write(prompt(3, num_tokens), decode_hit_tokens=hit_tokens)
    windows: list[int | None] = [None, 512] if with_full else [512]
    assert_window_written(write, 16, windows)
    assert write.message["num_held_blocks"] == [hit_tokens // 16] * len(windows)


def _older_decoder(window_start_page: int | None) -> Any:
    """The message of a decoder that states no held pages and counts N
    tokens external (vLLM's): its allocation freed the page of N - W when
    N - W ends its page."""

    def edit(message: dict[str, Any]) -> None:
        message.pop("num_held_blocks", None)
        if window_start_page is not None:
            message["block_notify_list"][window_start_page] = NULL

    return edit


def test_older_decoder_without_its_window_start_gets_no_write(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A null among the decoder's pages to write: nothing is written, the
    prefiller releases its blocks and tells the decoder the write failed."""
    pair = window_write_pair(llama_model_dir, monkeypatch, 16, 512, False)
    write = pair.write(prompt(4, 527), message=_older_decoder((527 - 512) // 16))
    assert write.group_pairs == [[]]
    assert write.notices == ["write_failed"]
    assert write.released


def test_older_decoder_is_written_by_position(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without held counts and with its window's pages: the pages of
    [N - W, N - 1), each to the decoder's page of the same positions."""
    pair = window_write_pair(llama_model_dir, monkeypatch, 16, 512, False)
    write = pair.write(prompt(5, 600), message=_older_decoder(None))
    assert_window_written(write, 16, [512])


def _step(
    scheduler: Scheduler,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
) -> dict[str, int]:
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = [
        [7]
        if scheduler.requests[r].num_computed_tokens + output.num_scheduled_tokens[r]
        >= scheduler.requests[r].num_tokens
        else []
        for r in req_ids
    ]
    scheduler.update_from_output(
        output,
        model_runner_output(
            req_ids,
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=finished_recving or set(),
                failed_recving=failed_recving or set(),
            ),
        ),
    )
    return dict(output.num_scheduled_tokens)


def test_null_page_falls_back_to_local_prefill_beside_a_write(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests wait for their WRITE on the decoder; one decoder table
    has a null page to write (an older decoder's window start). The
    prefiller writes the other and fails that one; the decoder's real
    scheduler recomputes it locally (counted), the other loads and runs."""
    pair = window_write_pair(llama_model_dir, monkeypatch, 16, 512, False)
    legs = pair.legs
    ok, bad = prompt(6, 600), prompt(7, 527)
    decode = legs.decode
    messages = {}

    for name, tokens in (("ok", ok), ("bad", bad)):
        decode.add_request(
            legs._request(
                name, tokens, write_params(f"t-{name}", do_remote_prefill=True)
            )
        )
    pair.sent.clear()
    assert _step(decode) == {}
    for message in pair.sent:
        messages[message["transfer_id"]] = copy.deepcopy(message)
    assert set(messages) == {"t-ok", "t-bad"}
    _older_decoder((527 - 512) // 16)(messages["t-bad"])

    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_common,
        moriio_engine,
    )

    notices: list[tuple[str, str]] = []
    with _role(moriio_common, moriio_common.ROLE.PRODUCER):
        wrapper = moriio_engine.MoRIIOWrapper()
        wrapper.send_notify = record_notices(notices, with_transfer=True)  # type: ignore[method-assign]
        worker = _Worker({LAYER: 0}, set(), wrapper)
        writer = moriio_engine.MoRIIOWriter(worker)  # type: ignore[arg-type]
        for name, tokens in (("ok", ok), ("bad", bad)):
            wrapper._handle_message(msgpack.dumps(messages[f"t-{name}"]))
            saved = None
            request = legs._request(
                name, tokens, write_params(f"t-{name}", do_remote_decode=True)
            )
            legs.prefill.add_request(request)
            while saved is None:
                output = legs.prefill.schedule()
                saved = output.kv_connector_metadata.reqs_to_save.get(name)
                legs._finish_step(legs.prefill, output)
            task = type(
                "Task",
                (),
                {
                    "request_id": name,
                    "transfer_id": f"t-{name}",
                    "dst_engine_id": "decode",
                    "local_block_ids": [list(g) for g in saved.local_block_ids],
                    "write_start_blocks": getattr(saved, "write_start_blocks", None),
                    "layer_name": LAYER,
                    "tp_mapping": None,
                    "refusal": None,
                    "event": _Event(),
                    "remote_ip": "127.0.0.1",
                    "remote_notify_port": 2,
                    "multi_pod_hosts": [],
                    "remote_dp_size_local": 0,
                },
            )()
            worker.pairs.clear()
            writer._execute_write_task(task)  # type: ignore[arg-type]
            if name == "ok":
                assert worker.pairs[LAYER]
                assert all(NULL not in p for p in worker.pairs[LAYER])
            else:
                assert worker.pairs == {}
    assert notices == [("t-bad", "write_failed")]

    # The decoder's workers report what the prefiller told them; the
    # scheduler drains the connector's counters as it goes.
    connector = decode.connector
    assert connector is not None
    take = connector.get_kv_connector_stats
    fallbacks: list[int] = []

    def spy() -> Any:
        stats = take()
        if stats is not None:
            fallbacks.append(stats.data.get("num_fallbacks", 0))
        return stats

    connector.get_kv_connector_stats = spy  # type: ignore[method-assign]
    scheduled = _step(decode, finished_recving={"ok", "bad"}, failed_recving={"bad"})
    assert fallbacks == [1]
    seen = dict(scheduled)
    while "ok" in decode.requests or "bad" in decode.requests:
        for req_id, n in _step(decode).items():
            seen.setdefault(req_id, n)
    # "ok" recomputes only its last prompt token; "bad" its whole prompt.
    assert seen == {"ok": 1, "bad": 527}
    assert all(
        r.status != RequestStatus.WAITING_FOR_REMOTE_KVS
        for r in decode.requests.values()
    )


@pytest.mark.parametrize("layout", ["dcp2", "mamba"])
def test_write_refuses_window_groups_it_cannot_pair(
    llama_model_dir: Path, layout: str
) -> None:
    """Guard: a window group under DCP 2, with or without a Mamba state
    group beside it, is refused at start in one line naming the group."""
    vllm_config = make_vllm_config(
        llama_model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        block_size=64,
    )
    groups = [
        ([LAYER], full_attention_spec(64)),
        ([f"{LAYER}.1"], sliding_window_spec(64, 128)),
    ]
    vllm_config.parallel_config.decode_context_parallel_size = 2
    if layout == "mamba":
        groups.append(([f"{LAYER}.2"], kda_mamba_spec(64)))
    with pytest.raises(NotImplementedError, match="sliding-window cache groups"):
        make_scheduler_connector(vllm_config, make_kv_cache_config(groups))
