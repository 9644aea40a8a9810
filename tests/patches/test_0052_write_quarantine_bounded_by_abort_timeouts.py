"""Patch 0052: a WRITE decoder holds the pages of a cancelled write no
producer acknowledged for the longer of ``transfer_timeout`` and
``recv_abort_timeout``, not an hour.

After the cancel a producer posts no more layers of the write and gives up
on a posted one within its ``transfer_timeout``; the decoder gives up on an
RDMA completion after ``recv_abort_timeout``. The decoder's quarantine
(``write_quarantine_timeout``) defaulted to 3600 s: against a dead
prefiller, or one of another build (it never acknowledges a cancel), every
aborted or overdue request held its pages for an hour.

The scheduler is vLLM's real ``Scheduler`` with the MoRIIO connector of a
WRITE decoder, its worker a real WRITE worker over stubbed mori; the
connector's clock is the test's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from tests.patches.builders import build_scheduler, full_attention_spec
from tests.patches.test_0033_write_failure_tells_the_decoder import B, LAYERS, _leg
from tests.patches.test_0043_write_deadline_cancels_the_write import (
    _cancels,
    _Sent,
    loopback,  # noqa: F401  (fixture)
)
from tests.patches.test_0045_aborted_write_wait_is_cancelled import (
    NUM_BLOCKS,
    _free_blocks,
    _step,
    _waiting,
)


class _Clock:
    """The connector's ``time`` module with a monotonic clock the test sets."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _scheduler(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    sent: list[tuple[str, dict[str, Any]]],
    extra_config: dict[str, Any],
) -> Scheduler:
    monkeypatch.setattr(
        moriio_connector,
        "make_zmq_socket",
        lambda ctx, path, **kw: _Sent(sent, path),
    )
    return build_scheduler(
        model_dir,
        "kv_consumer",
        [(list(LAYERS), full_attention_spec(B))],
        B,
        NUM_BLOCKS,
        read_mode=False,
        extra_config=extra_config,
    )


def _held_until(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    extra_config: dict[str, Any],
    seconds: float,
) -> tuple[bool, bool]:
    """A request aborted while its write is awaited; no producer ever
    acknowledges the cancel. Whether its pages are still held just before
    ``seconds`` after the cancel, and just after."""
    clock = _Clock()
    monkeypatch.setattr(moriio_connector, "time", clock)
    sent: list[tuple[str, dict[str, Any]]] = []
    scheduler = _scheduler(model_dir, monkeypatch, sent, extra_config)
    free = _free_blocks(scheduler)
    _waiting(scheduler, "x")
    decoder = _leg(model_dir, "kv_consumer").worker
    scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    assert len(_cancels(sent)) == 1
    clock.now += seconds - 1
    _step(scheduler, decoder, [])
    held_before = _free_blocks(scheduler) < free
    clock.now += 2
    _step(scheduler, decoder, [])
    held_after = _free_blocks(scheduler) < free
    if not held_after:
        assert "x" not in scheduler.requests
    return held_before, held_after


@pytest.mark.parametrize(
    ("extra_config", "seconds"),
    [
        ({}, 120.0),
        ({"transfer_timeout": 300.0}, 300.0),
        ({"recv_abort_timeout": 45.0, "transfer_timeout": 10.0}, 45.0),
    ],
    ids=["defaults", "transfer-timeout-longer", "recv-abort-timeout-longer"],
)
def test_unacknowledged_cancel_holds_pages_for_the_longer_abort_timeout(
    loopback: list[bytes],  # noqa: F811
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    extra_config: dict[str, Any],
    seconds: float,
) -> None:
    """Without write_quarantine_timeout the pages of the unacknowledged
    cancelled write are held until the longer of transfer_timeout and
    recv_abort_timeout (120 s and 30 s by default), then freed."""
    assert _held_until(llama_model_dir, monkeypatch, extra_config, seconds) == (
        True,
        False,
    )


def test_stated_quarantine_still_holds_the_pages(
    loopback: list[bytes],  # noqa: F811
    llama_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stated write_quarantine_timeout is the hold, longer or shorter than
    the abort timeouts."""
    for quarantine in (600.0, 20.0):
        assert _held_until(
            llama_model_dir,
            monkeypatch,
            {"write_quarantine_timeout": quarantine},
            quarantine,
        ) == (True, False)
