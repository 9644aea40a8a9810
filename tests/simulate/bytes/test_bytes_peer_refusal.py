"""A configuration whose decoder refuses its peer at the first handshake
(a layer READ cannot move between the two TP sizes), or whose WRITE
prefiller does (a group it cannot write), is refused at start,
in the connector's own line, not counted as crashes: the eager handshake's
wrapper names the peer's address, which differs from case to case, so the
three-identical-errors rule never saw one refusal."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from vllm_overlay.simulate.bytes import driver, rank
from vllm_overlay.simulate.bytes.driver import CaseBytes, run_config
from vllm_overlay.simulate.bytes.steps import PeerRefused

REFUSAL = (
    "MoRIIO READ cannot serve layer model.layers.0.short_conv between prefill "
    "TP 1 and decode TP 2: its recurrent state has no conv split to slice by rank"
)


def _wrapped(port: int) -> str:
    return (
        "Traceback (most recent call last):\n  ...\n"
        "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common."
        f"HandshakeError: Eager MoRIIO handshake failed for 127.0.0.1:{port} on "
        "at least one TP rank; failing this step fast to avoid a TP collective "
        f"hang: {REFUSAL}"
    )


class _Driver:
    """Cases whose rank processes raise ``errors`` in turn."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors

    def start(self) -> None:
        pass

    def stop(self, reuse: bool = False) -> None:
        pass

    def run_case(self, n: int, hit: float) -> CaseBytes:
        error = driver._first_error(self.errors.pop(0))
        return CaseBytes(n, hit, wrong=False, error=error)


def _run(monkeypatch, errors: list[str]) -> Any:
    monkeypatch.setattr(driver, "Driver", lambda *a, **k: _Driver(errors))
    return run_config(None, [(0.0, 17), (0.0, 129), (1.0, 530)])  # type: ignore[arg-type]


def test_a_peer_refused_at_the_handshake_refuses_the_configuration(monkeypatch):
    run = _run(monkeypatch, [_wrapped(10000 + i) for i in range(3)])
    assert run.refused_at_start == REFUSAL
    assert len(run.cases) == 1


SPLIT_REFUSAL = (
    "MoRIIO READ cannot split the 3 KV heads of layer "
    "model.layers.0.self_attn.attn between prefill tp_size=1 and decode "
    "tp_size=2"
)


def test_a_layer_whose_heads_cannot_be_split_refuses_the_configuration(
    monkeypatch,
):
    """The READ decoder's refusal of a layer whose KV heads the two TP sizes
    cannot split (patch 0027), wrapped like any peer refusal."""
    errors = [_wrapped(10000 + i).replace(REFUSAL, SPLIT_REFUSAL) for i in range(3)]
    run = _run(monkeypatch, errors)
    assert run.refused_at_start == SPLIT_REFUSAL
    assert len(run.cases) == 1


WRITE_REFUSAL = (
    "MoRIIO WRITE cannot serve circular-buffer group 2 "
    "(model.layers.1.self_attn.kpool_tail) between prefill TP 1 and decode "
    "TP 2: a ring's page is sized by its rank, not split by KV head"
)


def test_a_write_prefiller_refusing_its_peer_refuses_the_configuration(monkeypatch):
    """The WRITE prefiller's refusal at its first handshake, raised out of
    its forward before any write is queued, refuses the configuration too."""
    error = (
        "Traceback (most recent call last):\n  ...\n"
        "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common."
        f"HandshakeError: {WRITE_REFUSAL}"
    )
    run = _run(monkeypatch, [error] * 3)
    assert run.refused_at_start == WRITE_REFUSAL
    assert len(run.cases) == 1


def test_other_case_errors_are_still_crashes(monkeypatch):
    errors = [f"RuntimeError: rank {i} died" for i in range(3)]
    run = _run(monkeypatch, errors)
    assert run.refused_at_start is None
    assert [c.error for c in run.cases] == [
        f"RuntimeError: rank {i} died" for i in range(3)
    ]


def test_a_refusal_the_connector_logs_is_raised_by_the_rank():
    """A READ decoder that logs its refusal of the peer (and recomputes the
    step's READs from it) ends the case with that line, as one that raises
    it does; another error line ends nothing."""
    logger = logging.getLogger("vllm.distributed.kv_transfer.moriio_test")
    with rank._logged_refusal_raised():
        logger.error("MoRIIO READ of request %s could not be posted", "r1")
    with pytest.raises(PeerRefused) as raised, rank._logged_refusal_raised():
        logger.error(
            "Eager MoRIIO handshake failed for %s on at least one TP rank; "
            "its READs of this step are recomputed: %s",
            "127.0.0.1:10000",
            REFUSAL,
        )
    error = driver._first_error(f"{type(raised.value).__name__}: {raised.value}")
    assert driver.peer_refusal(error) == REFUSAL
