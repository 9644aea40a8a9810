"""Transport faults of the byte simulator (``simulate-bytes --faults``).

The loopback stand-in faults only the posts made for the faulted requests
(``posting_for``): an error moves nothing, a hang never completes, a partial
transfer lands some layers and pages and fails the rest, a prefiller that
drops out completes its first post and no other, a late prefiller makes its
second post late (past a WRITE decoder's deadline). The judge must fail a
transfer cut short that reports success, and the table and verdict count
what became of the faulted request.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from vllm_overlay.command import UsageError
from vllm_overlay.simulate.bytes.cli import fault_items, parse_fault_kinds
from vllm_overlay.simulate.bytes.report import (
    BytesReport,
    ConfigItem,
    ConfigReport,
    fault_cell,
    fault_failures,
    format_fault_table,
)
from vllm_overlay.simulate.bytes.run import ZygoteSession
from vllm_overlay.simulate.bytes.verdict import judge

STANDIN = (
    Path(__file__).resolve().parents[3]
    / "vllm_overlay/simulate/bytes/standin/mori/io/_loopback.py"
)
SIZE = 1 << 12


def _load():
    spec = importlib.util.spec_from_file_location("loopback_faults", STANDIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


io = _load()


@pytest.fixture
def session(tmp_path):
    """An engine reading from a second engine's region, both in this
    process (the stand-in reaches a region through its file either way)."""
    src = np.memmap(tmp_path / "src", dtype=np.uint8, mode="w+", shape=(SIZE,))
    src[:] = 7
    dst = np.memmap(tmp_path / "dst", dtype=np.uint8, mode="w+", shape=(SIZE,))
    target = io.IOEngine("target", io.IOEngineConfig("127.0.0.1", 0))
    target.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
    remote_mem = target.register_memory(
        src.ctypes.data, SIZE, -1, io.MemoryLocationType.CPU
    )
    engine = io.IOEngine("initiator", io.IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
    engine.register_remote_engine(target.get_engine_desc())
    local_mem = engine.register_memory(
        dst.ctypes.data, SIZE, -1, io.MemoryLocationType.CPU
    )
    yield engine, engine.create_session(local_mem, remote_mem), dst
    io.set_transport_fault(None)
    engine.shutdown()
    target.shutdown()


def _read(engine, session, request_id, offsets, timeout_ms=2000):
    """One batch READ of 16-byte runs at ``offsets``, posted for
    ``request_id``; its status once waited for."""
    with io.posting_for(request_id):
        status = session.batch_read(offsets, offsets, [16] * len(offsets), 0)
    engine.wait_all([status], timeout_ms=timeout_ms)
    return status


def test_an_error_moves_nothing_and_spares_other_requests(session):
    engine, sess, dst = session
    io.set_transport_fault(io.TransportFault("error", "x"))
    failed = _read(engine, sess, "x1", [0, 64])
    assert failed.Failed() and failed.Code() == io.StatusCode.ERR_RDMA_OP
    assert not dst[:80].any()
    other = _read(engine, sess, "c1", [128])
    assert other.Succeeded()
    assert (dst[128:144] == 7).all()
    assert engine.loopback_stats.faulted_posts == 1


def test_a_hang_never_completes_nor_lands(session):
    engine, sess, dst = session
    io.set_transport_fault(io.TransportFault("hang", "x"))
    status = _read(engine, sess, "x1", [0], timeout_ms=50)
    assert status.Code() == io.StatusCode.IN_PROGRESS
    assert engine.wait_all([status], timeout_ms=50) == io.StatusCode.IN_PROGRESS
    assert not dst.any()


def test_a_partial_transfer_lands_some_pages_and_layers_and_fails(session):
    engine, sess, dst = session
    io.set_transport_fault(io.TransportFault("partial", "x"))
    first = _read(engine, sess, "x1", [0, 64])
    assert first.Failed()
    assert (dst[:16] == 7).all() and not dst[64:80].any()
    second = _read(engine, sess, "x1", [256])
    assert second.Succeeded() and (dst[256:272] == 7).all()
    third = _read(engine, sess, "x1", [512])
    assert third.Failed()
    assert (dst[512:520] == 7).all() and not dst[520:528].any()


def test_a_dropped_prefiller_completes_its_first_post_only(session):
    engine, sess, dst = session
    io.set_transport_fault(io.TransportFault("drop", "x"))
    assert _read(engine, sess, "x1", [0]).Succeeded()
    later = _read(engine, sess, "x1", [64], timeout_ms=50)
    assert later.Code() == io.StatusCode.IN_PROGRESS
    assert not dst[64:80].any()


def test_a_late_post_stalls_then_lands(session, monkeypatch):
    engine, sess, dst = session
    monkeypatch.setattr(io, "LATE_POST_S", 0.3)
    io.set_transport_fault(io.TransportFault("late", "x"))
    started = time.monotonic()
    assert _read(engine, sess, "x1", [0]).Succeeded()
    assert time.monotonic() - started < 0.3
    second = _read(engine, sess, "x1", [64])
    assert time.monotonic() - started >= 0.3
    assert second.Succeeded() and (dst[64:80] == 7).all()
    assert _read(engine, sess, "x1", [128]).Succeeded()
    assert time.monotonic() - started < 0.6
    assert engine.loopback_stats.faulted_posts == 1


def test_a_lying_transfer_reports_success_with_half_its_bytes(session):
    engine, sess, dst = session
    io.set_transport_fault(io.TransportFault("lie", "x"))
    status = _read(engine, sess, "x1", [0, 64])
    assert status.Succeeded()
    assert (dst[:16] == 7).all() and not dst[64:80].any()


def test_an_unknown_fault_is_refused():
    with pytest.raises(ValueError, match="unknown transport fault"):
        io.set_transport_fault(io.TransportFault("slow", "x"))


def test_the_fault_plan_runs_drop_and_late_in_write_only():
    items = fault_items(
        parse_fault_kinds("all"), ["llama"], ["read", "write"], [(1, 1)], ["LBNHC"]
    )
    faults = [(item.fault, item.mode) for item in items]
    for kind in ("drop", "late"):
        assert (f"transport-{kind}", "read") not in faults
        assert (f"transport-{kind}", "write") in faults
    assert len(faults) == 8
    assert all(item.hit_offset is None for item in items)
    with pytest.raises(UsageError, match="unknown"):
        parse_fault_kinds("slow")
    assert parse_fault_kinds("lie") == ("lie",)


def test_the_abort_runs_in_write_only_and_only_when_asked():
    """``abort`` (the decoder aborts a request waiting for its WRITE) is
    not in ``all``; asked for, it runs in WRITE only."""
    assert "abort" not in parse_fault_kinds("all")
    items = fault_items(
        parse_fault_kinds("abort"), ["llama"], ["read", "write"], [(1, 1)], ["LBNHC"]
    )
    assert [(item.fault, item.mode) for item in items] == [("transport-abort", "write")]


def _row(variant: str, **fields) -> ConfigReport:
    item = ConfigItem("llama", "read", 1, 1, "LBNHC", fault="transport-error")
    return ConfigReport(variant=variant, item=item, cases=2, fault_fired=2, **fields)


def test_a_recomputed_fault_passes_and_a_wrong_or_hung_one_fails():
    ok = _row("overlay", fault_outcomes={"recomputed": 2})
    assert fault_failures(ok) == 0
    assert fault_cell(ok) == "2 / 0 / 0 / 0"
    wrong = _row("overlay", fault_outcomes={"wrong": 1, "hung": 1})
    assert fault_failures(wrong) == 2
    assert fault_cell(wrong) == "0 / 1 / 1 / 0"
    report = BytesReport([17], [0.0], {"overlay": "x"}, [wrong], 1.0)
    line = judge(report, []).line()
    assert line.startswith("simulate-bytes: FAILED")
    assert "computed on wrong bytes in 1 of 2 cases" in line
    assert "hung in 1 of 2 cases" in line


def test_base_fault_failures_are_counted_not_judged():
    base = _row("base", fault_outcomes={"hung": 2}, leak_cases=1)
    overlay = _row("overlay", fault_outcomes={"recomputed": 2})
    report = BytesReport(
        [17], [0.0], {"base": "b", "overlay": "o"}, [base, overlay], 1.0
    )
    verdict = judge(report, [])
    assert verdict.exit_code == 0
    assert "base (vLLM's own MoRIIO, not judged): 3 fault cases failed" in (
        verdict.line()
    )
    table = format_fault_table(report)
    assert "error" in table and "0 / 0 / 2 / 0 (1 leaks)" in table


def test_blocks_held_for_a_read_in_flight_show_and_pass():
    """A decoder that holds the blocks of a failed READ whose posts never
    ended (a hang) passes: held, not a leak."""
    row = _row("overlay", fault_outcomes={"recomputed": 2}, held_cases=2)
    assert fault_failures(row) == 0
    assert fault_cell(row) == "2 / 0 / 0 / 0 (2 held)"
    report = BytesReport([17], [0.0], {"overlay": "x"}, [row], 1.0)
    assert judge(report, []).exit_code == 0


def test_a_fault_that_never_fired_shows():
    row = _row("overlay", fault_outcomes={"loaded": 2})
    row.fault_fired = 0
    assert "fault never fired" in fault_cell(row)


def _fault(
    zygote: ZygoteSession, mode: str, fault: str, layout: str = "llama"
) -> ConfigReport:
    """``layout`` at TP 1->1 on the installed build, one length, the
    transport fault ``fault`` under one of two requests in flight."""
    item = ConfigItem(
        layout, mode, 1, 1, "LBNHC", fault=f"transport-{fault}", lengths="17"
    )
    [report] = zygote.run([item], "17", "0")
    assert report.refused_at_start is None, report.refused_at_start
    assert report.cases == 1
    assert report.error_cases == 0, report.first_errors
    assert report.fault_fired > 0
    return report


@pytest.mark.parametrize(
    ("mode", "fault"),
    [("read", "error"), ("read", "partial"), ("write", "error"), ("write", "hang")],
)
def test_a_failed_transfer_is_recomputed_next_to_a_right_one(byte_zygote, mode, fault):
    report = _fault(byte_zygote, mode, fault)
    assert report.fault_outcomes == {"recomputed": 1}
    assert report.wrong_cases == 0, report.wrong_notes
    assert report.leak_cases == 0, report.leak_notes


@pytest.mark.parametrize("fault", ["error", "partial"])
def test_a_recomputed_requests_zeroed_blocks_are_no_stray_bytes(byte_zygote, fault):
    """LFM3 (a state group beside attention groups of other bytes per
    block): the faulted READ's request is recomputed on new blocks, which
    vLLM zeroes whole (every layer's page), next to the judged request."""
    report = _fault(byte_zygote, "read", fault, layout="lfm3")
    assert report.fault_outcomes == {"recomputed": 1}
    assert report.wrong_cases == 0, report.wrong_notes
    assert report.leak_cases == 0, report.leak_notes


def test_a_prefiller_silent_after_its_first_layer_is_cancelled_and_recomputed(
    byte_zygote,
):
    """The decoder cancels the write past its deadline; with no
    acknowledgement (the prefiller is gone) it reuses the pages only after
    the quarantine, then recomputes the request; no stray byte, no leak."""
    report = _fault(byte_zygote, "write", "drop")
    assert report.fault_outcomes == {"recomputed": 1}
    assert report.wrong_cases == 0, report.wrong_notes
    assert report.leak_cases == 0, report.leak_notes


def test_a_transfer_cut_short_that_reports_success_is_judged_wrong(byte_zygote):
    report = _fault(byte_zygote, "read", "lie")
    assert report.fault_outcomes == {"wrong": 1}
    assert fault_failures(report) == 1
    assert "wrong bytes" in report.wrong_notes[0]
