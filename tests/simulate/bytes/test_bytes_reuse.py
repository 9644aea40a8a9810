"""Rank processes outlive their configuration: a rank closes, its process
takes the next configuration's rank; a failed case, a fault or
``RANK_REUSE`` configurations get new processes."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_overlay.simulate.bytes import driver
from vllm_overlay.simulate.bytes.driver import RankError, _Leg, reap_ranks, retire_idle


def _fake_rank(conn: Any) -> None:
    """Speaks the rank protocol: ``start`` answers ok, or the configuration's
    ``refuse`` as an error; ``release`` answers ok unless the configuration
    says ``stuck``; ``exit`` ends the process."""
    cfg = None
    while True:
        cmd, args = conn.recv()
        if cmd == "exit":
            os._exit(0)
        if cmd == "start":
            cfg = args[0]
            conn.send(("error", cfg.refuse) if cfg.refuse else ("ok", None))
        elif cmd == "release":
            if cfg is not None and cfg.stuck:
                os._exit(3)
            conn.send(("ok", None))


class _Ctx:
    def __init__(self) -> None:
        self._mp = multiprocessing.get_context("fork")
        self.forks = 0

    def Pipe(self) -> Any:  # noqa: N802 - multiprocessing's name
        return self._mp.Pipe()

    def Process(self, target: Any, args: Any, daemon: bool) -> Any:  # noqa: N802
        self.forks += 1
        return self._mp.Process(target=_fake_rank, args=args, daemon=daemon)


def _cfg(**kw: Any) -> Any:
    return SimpleNamespace(**{"fault": None, "refuse": None, "stuck": False, **kw})


@pytest.fixture
def ctx() -> Iterator[_Ctx]:
    yield _Ctx()
    retire_idle()
    reap_ranks(wait=True)
    assert driver._IDLE == []


def _pids(leg: _Leg) -> set[int]:
    return {p.pid for p in leg.procs}


def _ready(ctx: _Ctx, *cfgs: Any, fresh: bool = False) -> _Leg:
    """A leg of ``cfgs`` (default: one plain rank), its ranks started."""
    leg = _Leg(ctx, list(cfgs) or [_cfg()], fresh=fresh)
    leg.wait_ready()
    return leg


def test_a_released_process_takes_the_next_configuration(ctx: _Ctx) -> None:
    first = _ready(ctx, _cfg(), _cfg())
    pids = _pids(first)
    first.close(reuse=True)
    second = _ready(ctx)
    assert _pids(second) <= pids
    assert ctx.forks == 2
    second.close(reuse=True)


def test_without_reuse_fresh_or_a_fault_the_processes_are_new(ctx: _Ctx) -> None:
    _ready(ctx).close(reuse=False)
    assert driver._IDLE == []
    _ready(ctx).close(reuse=True)
    fresh = _ready(ctx, fresh=True)
    fault = _ready(ctx, _cfg(fault="shift-local"))
    assert ctx.forks == 4
    fault.close(reuse=True)
    assert not _pids(fault) & {p.proc.pid for p in driver._IDLE}
    fresh.close(reuse=True)


def test_a_process_retires_after_rank_reuse_configurations(
    ctx: _Ctx, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(driver, "RANK_REUSE", 3)
    for _ in range(7):
        _ready(ctx).close(reuse=True)
    assert ctx.forks == 3


def test_a_rank_refused_at_start_keeps_its_process(ctx: _Ctx) -> None:
    leg = _Leg(ctx, [_cfg(refuse="planner: no"), _cfg()])
    with pytest.raises(RankError, match="planner: no"):
        leg.wait_ready()
    assert leg.ready == [True, True]
    leg.close(reuse=True)
    again = _ready(ctx, _cfg(), _cfg())
    assert ctx.forks == 2
    again.close(reuse=True)


def test_a_process_that_cannot_close_its_rank_is_replaced(ctx: _Ctx) -> None:
    leg = _ready(ctx, _cfg(stuck=True))
    (stuck,) = _pids(leg)
    leg.close(reuse=True)
    nxt = _ready(ctx)
    assert _pids(nxt) != {stuck}
    assert ctx.forks == 2
    nxt.close(reuse=True)


def test_a_process_that_died_idle_is_replaced(ctx: _Ctx) -> None:
    _ready(ctx).close(reuse=True)
    (idle,) = driver._IDLE
    assert driver._take_idle() is idle
    idle.proc.kill()
    idle.proc.join()
    driver._IDLE.append(idle)
    nxt = _ready(ctx)
    assert _pids(nxt) != {idle.proc.pid}
    assert ctx.forks == 2
    nxt.close(reuse=True)
