"""An exception out of a leg's ``Scheduler.schedule()`` is an escape (a
server's engine dies), counted apart from the other crashes; the fault mode
drives the decoder's refusals through the real scheduler with another
request in flight."""

from __future__ import annotations

import pytest

from vllm_overlay.simulate.check import FULL, WINDOW
from vllm_overlay.simulate.faults import (
    FAULTS,
    Fault,
    FaultContext,
    FaultReport,
    apply_payload,
    parse_faults,
)
from vllm_overlay.simulate.report import LayoutReport

# A fault case whose "faulty" payload is the prefiller's own: the harness
# runs, nothing is refused.
UNCHANGED = Fault("unchanged", "nothing", payload=lambda lists, ctx: lists)


def test_an_exception_in_a_hook_is_counted_as_an_escape(llama_pair, monkeypatch):
    connector = llama_pair.d.scheduler.connector

    def refuse(request, num_computed_tokens):
        raise RuntimeError("injected refusal")

    monkeypatch.setattr(connector, "get_num_new_matched_tokens", refuse)
    result = llama_pair.run_case(40, 0.0)
    assert result.escaped
    assert result.error == "escaped D schedule(): RuntimeError: injected refusal"
    report = LayoutReport(variant="overlay", layout="llama", note="")
    report.add(result)
    assert (report.error_cases, report.escape_cases) == (1, 1)
    # The pair was rebuilt: the next case runs clean.
    assert llama_pair.run_case(40, 0.0).error is None


def test_a_crash_outside_the_scheduler_is_no_escape(llama_pair):
    def broken(local, remote, tables):
        raise RuntimeError("harness crash")

    result = llama_pair.run_case(40, 0.0, rewrite=broken)
    assert result.error is not None and not result.escaped


def test_a_fault_case_counts_the_escape_and_the_request_in_flight(llama_pair):
    case = llama_pair.run_fault_case(40, 0.0, FAULTS["hook-raises"])
    assert case.injected and case.escaped and not case.other_right
    assert case.error == (
        "escaped D schedule(): RuntimeError: injected: "
        "get_num_new_matched_tokens(f" + case.error.split("(f")[1]
    )
    report = FaultReport("overlay", "llama", "hook-raises")
    report.add(case)
    assert (report.cases, report.escapes, report.crashes) == (1, 1, 0)


def test_a_fault_case_without_the_fault_serves_both_requests(llama_pair):
    """The same two requests with nothing refused: both read, the intact
    one right: the check can pass."""
    case = llama_pair.run_fault_case(40, 0.5, UNCHANGED)
    assert case.injected and not case.escaped and case.error is None
    assert case.other_right and not case.refused_wrong


def test_payload_faults_rewrite_only_what_they_name():
    ctx = FaultContext([FULL, WINDOW], null_block=0)
    params = {"remote_block_ids": [[1, 2, 3, 4], [7, 8]]}
    assert apply_payload(FAULTS["null-window"], params, ctx)
    assert params["remote_block_ids"] == [[1, 2, 3, 4], [7, 0]]
    params = {"remote_block_ids": [[1, 2, 3, 4], [7, 8]]}
    assert apply_payload(FAULTS["short-table"], params, ctx)
    assert params["remote_block_ids"] == [[1, 2], [7, 8]]
    params = {"remote_block_ids": [[1, 2, 3, 4], [7, 8]]}
    assert apply_payload(FAULTS["group-count"], params, ctx)
    assert params["remote_block_ids"] == [[1, 2, 3, 4]]
    one = {"remote_block_ids": [[1, 2]]}
    assert not apply_payload(FAULTS["group-count"], one, FaultContext([FULL], 0))
    assert not apply_payload(FAULTS["null-window"], one, FaultContext([FULL], 0))
    assert one == {"remote_block_ids": [[1, 2]]}


def test_fault_names():
    assert parse_faults("all") == [
        "group-count",
        "short-table",
        "null-window",
    ]
    assert parse_faults("hook-raises,all")[0] == "hook-raises"
    with pytest.raises(ValueError, match="unknown fault"):
        parse_faults("nope")


@pytest.fixture(scope="module")
def kimi_pair():
    from vllm_overlay.simulate.drive import Pair
    from vllm_overlay.simulate.layouts import expand

    return Pair(expand(["kimi"])[0], max_model_len=1024, port=47200)


def test_a_hybrid_request_prefilled_locally_holds_its_whole_prompt(
    kimi_pair, monkeypatch
):
    """A request the decoder's connector serves by local prefill (no external
    token) is judged once its forward computed the prompt: its state groups
    then hold the state after all n tokens, not after n - 1."""
    connector = kimi_pair.d.scheduler.connector
    count = connector.get_num_new_matched_tokens

    def local_for_the_faulty_one(request, num_computed_tokens):
        got = count(request, num_computed_tokens)
        return (0, False) if request.request_id.startswith("f") else got

    monkeypatch.setattr(
        connector, "get_num_new_matched_tokens", local_for_the_faulty_one
    )
    case = kimi_pair.run_fault_case(100, 0.0, UNCHANGED)
    assert case.injected and not case.escaped and case.error is None
    assert case.other_right and not case.refused_wrong
