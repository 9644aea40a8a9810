"""Parallel test workers never hand out the same loopback port."""

from __future__ import annotations

import pytest

from tests.e2e import ports


def _handed_out(worker: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setattr(ports, "_HANDED_OUT", set())
    return [ports.free_port() for _ in range(40)]


def test_two_workers_never_share_a_port(monkeypatch: pytest.MonkeyPatch) -> None:
    gw0, gw1 = (_handed_out(w, monkeypatch) for w in ("gw0", "gw1"))
    assert len(set(gw0)) == len(gw0) and len(set(gw1)) == len(gw1)
    assert not set(gw0) & set(gw1)
    assert {ports.owner(p, 2) for p in gw0} == {0}
    assert {ports.owner(p, 2) for p in gw1} == {1}
    assert ports.TOY_PROXY_PORT not in gw0 + gw1


def test_one_process_owns_every_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert ports.worker_share() == (0, 1)
    assert {ports.owner(p, 1) for p in range(30000, 30010)} == {0}
