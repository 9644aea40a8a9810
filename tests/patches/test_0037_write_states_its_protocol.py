"""WRITE: the prefiller states its protocol in each ``write_done``, and a
decoder with a sliding-window or chunked local group takes a write only
from a prefiller that states it.

A prefiller that states none computes every prompt token, frees the block
holding the window's first position while it writes it, and pairs each
group's pages from page 0: its bytes in a window group may be wrong. The
decoder's real worker reports such a transfer in ``failed_recving`` (vLLM's
kv_load_failure_policy recomputes the request or fails it); a decoder
without such a group takes either message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.patches.builders import (
    LAYER,
    _role,
    _Worker,
    build_worker,
    chunked_local_spec,
    full_attention_spec,
    make_kv_cache_config,
    make_vllm_config,
    moriio_kv_transfer_config,
    sliding_window_spec,
)

GROUPS = {
    "full": [([LAYER], full_attention_spec(16))],
    "window": [
        ([LAYER], full_attention_spec(16)),
        ([f"{LAYER}.1"], sliding_window_spec(16, 128)),
    ],
    "chunk": [([LAYER], chunked_local_spec(16, 64))],
}

# What a prefiller that predates the statement sends once it wrote a transfer.
UNSTATED_WRITE_DONE = {"type": "write_done", "transfer_id": "t-1"}


def _decoder_wrapper(llama_model_dir: Path, groups: str) -> Any:
    """A real ``MoRIIOWrapper`` as the decoder's real worker configures it
    (the worker is built on a stand-in wrapper)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_engine

    vllm_config = make_vllm_config(
        llama_model_dir, moriio_kv_transfer_config("kv_consumer", read_mode=False)
    )
    worker = build_worker(vllm_config, make_kv_cache_config(GROUPS[groups]))
    try:
        wrapper = moriio_engine.MoRIIOWrapper()
        for name, value in vars(worker.moriio_wrapper).items():
            if name in vars(wrapper) and isinstance(value, bool):
                setattr(wrapper, name, value)
    finally:
        worker.shutdown()
    return wrapper


def _received(wrapper: Any, message: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(written, failed) transfers after the decoder's wrapper took
    ``message``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common

    with _role(moriio_common, moriio_common.ROLE.CONSUMER):
        wrapper._handle_message(msgpack.dumps(message))
    return wrapper.pop_finished_write_req_ids(), wrapper.pop_failed_write_req_ids()


def _stated_write_done(num_writers: int) -> dict[str, Any]:
    """The write_done the prefiller's real writer sends once a transfer is
    written (``num_writers`` of its ranks write the decoder's rank)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_common,
        moriio_engine,
    )

    sent: list[dict[str, Any]] = []

    def send_notify(
        transfer_id: str,
        ip: str,
        port: int,
        message_type: str | None = None,
        message_fields: dict[str, Any] | None = None,
    ) -> None:
        sent.append(
            {"type": message_type, "transfer_id": transfer_id, **(message_fields or {})}
        )

    with _role(moriio_common, moriio_common.ROLE.PRODUCER):
        wrapper = moriio_engine.MoRIIOWrapper()
        wrapper.send_notify = send_notify  # type: ignore[method-assign]
        wrapper.waiting_for_transfer_complete = lambda *a, **k: None  # type: ignore[method-assign]
        worker = _Worker({LAYER: 0}, set(), wrapper)
        writer = moriio_engine.MoRIIOWriter(worker)  # type: ignore[arg-type]
        info = moriio_common.RemoteAllocInfo(
            block_ids=[[1]],
            writes_done=1,
            writes_expected=1,
            completion_request_id="r-1",
            completion_notify_targets={("127.0.0.1", 2): num_writers},
            completion_targets_resolved=True,
        )
        writer._finalize_if_complete("t-1", info)
    assert len(sent) == 1
    return sent[0]


@pytest.mark.parametrize("groups", ["window", "chunk"])
def test_unstated_write_done_is_a_failed_receive(
    stub_mori: None, llama_model_dir: Path, groups: str
) -> None:
    """A decoder with a window or chunk group reports a write from a
    prefiller that states no protocol as failed, never as received."""
    wrapper = _decoder_wrapper(llama_model_dir, groups)
    assert _received(wrapper, UNSTATED_WRITE_DONE) == (set(), {"t-1"})


@pytest.mark.parametrize("groups", ["window", "chunk", "full"])
def test_stated_write_done_is_received(
    stub_mori: None, llama_model_dir: Path, groups: str
) -> None:
    """The prefiller's write_done states its protocol; every decoder takes it
    as received."""
    message = _stated_write_done(1)
    assert "moriio_protocol" in message
    wrapper = _decoder_wrapper(llama_model_dir, groups)
    assert _received(wrapper, message) == ({"t-1"}, set())


@pytest.mark.parametrize("num_writers", [1, 2])
def test_decoder_without_window_groups_takes_any_write_done(
    stub_mori: None, llama_model_dir: Path, num_writers: int
) -> None:
    """Guard: a decoder with full attention only takes the write_done of any
    prefiller (with or without the statement, the new field unknown to it),
    once every writer reported."""
    message = _stated_write_done(num_writers)
    assert message.get("num_writers", 1) == num_writers
    wrapper = _decoder_wrapper(llama_model_dir, "full")
    for _ in range(num_writers - 1):
        assert _received(wrapper, message) == (set(), set())
    assert _received(wrapper, message) == ({"t-1"}, set())
    assert _received(wrapper, UNSTATED_WRITE_DONE) == ({"t-1"}, set())
