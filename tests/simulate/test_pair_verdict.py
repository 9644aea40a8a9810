"""The verdicts judge every pair of builds with an overlaid leg, and an
escape out of the scheduler is its own problem (``escapes``), listed in the
known-gaps file by layout, problem and pair."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_overlay.simulate.bytes.driver import is_escape
from vllm_overlay.simulate.bytes.report import BytesReport, ConfigItem, ConfigReport
from vllm_overlay.simulate.bytes.steps import SchedulerEscape
from vllm_overlay.simulate.bytes.verdict import judge as judge_bytes
from vllm_overlay.simulate.faults import FaultReport
from vllm_overlay.simulate.report import LayoutReport, SweepReport
from vllm_overlay.simulate.verdict import (
    GapsError,
    KnownGap,
    judge,
    load_gaps,
    problems,
)

PAIRS = {v: "" for v in ("base", "overlay", "base->overlay", "overlay->base")}


def _row(variant: str, **kw: object) -> LayoutReport:
    return LayoutReport(
        variant=variant, layout="gemma", note="", lengths_tried=4, cases=4, **kw
    )


def _sweep(*rows: LayoutReport, faults: list[FaultReport] | None = None) -> SweepReport:
    return SweepReport("17", [0.0], PAIRS, list(rows), 1.0, faults=faults or [])


def test_a_mixed_pair_with_wrong_kv_fails_unless_listed_for_that_pair():
    rows = [
        _row("base", wrong_lengths=[529]),
        _row("overlay"),
        _row("base->overlay", wrong_lengths=[529]),
    ]
    verdict = judge(_sweep(*rows), [])
    assert verdict.failures == [
        "gemma (base->overlay) reads wrong KV at 1 of 4 lengths"
    ]
    gap = KnownGap("gemma", "wrong KV", "issue 35", "0008", pair="base->overlay")
    assert judge(_sweep(*rows), [gap]).exit_code == 0
    other = KnownGap("gemma", "wrong KV", "issue 35", "0008", pair="overlay->base")
    assert judge(_sweep(*rows), [other]).exit_code == 1


def test_an_escape_is_its_own_problem():
    row = _row("overlay", error_cases=3, escape_cases=2, first_errors=["x"])
    assert [p for p, _ in problems(row)] == ["errors", "escapes"]
    only = _row("overlay", error_cases=2, escape_cases=2)
    assert [p for p, _ in problems(only)] == ["escapes"]
    gap = KnownGap("gemma", "escapes", "issue 35", "fail-closed checks raise")
    assert judge(_sweep(only), [gap]).exit_code == 0
    assert judge(_sweep(only), []).exit_code == 1


def test_fault_rows_fail_on_an_escape_unless_listed():
    row = FaultReport("overlay", "gemma", "null-window", cases=2, escapes=2)
    verdict = judge(_sweep(faults=[row]), [])
    assert verdict.failures == [
        "gemma null-window an exception escapes the scheduler in 2 of 2 cases"
    ]
    for layout in ("gemma", "gemma null-window"):
        gap = KnownGap(layout, "escapes", "issue 35", "raises", scope="faults")
        assert judge(_sweep(faults=[row]), [gap]).exit_code == 0
    served = FaultReport(
        "overlay", "gemma", "null-window", cases=2, other_right=2, refused_local=2
    )
    assert judge(_sweep(faults=[served]), []).exit_code == 0
    base = FaultReport("base", "gemma", "null-window", cases=2, escapes=2)
    assert judge(_sweep(faults=[base]), []).exit_code == 0


def test_bytes_escapes_are_read_from_the_ranks_error():
    exc = SchedulerEscape.of("kv_consumer", "schedule()", ValueError("boom"))
    line = f"vllm_overlay.simulate.bytes.rank.SchedulerEscape: {exc}"
    assert is_escape(line)
    assert not is_escape("MoRIIOError: escaped nothing")
    item = ConfigItem("gemma", "read", 1, 1, "LBNHC")
    row = ConfigReport("base->overlay", item, cases=4, error_cases=1, escape_cases=1)
    report = BytesReport([17], [0.0], PAIRS, [row], 1.0)
    verdict = judge_bytes(report, [])
    assert verdict.failures == [
        "gemma read 1->1 LBNHC (base->overlay) an exception escapes the scheduler "
        "in 1 of 4 cases"
    ]
    gap = KnownGap("gemma read", "escapes", "issue 35", "x", "bytes", "base->overlay")
    assert judge_bytes(report, [gap]).exit_code == 0


def test_a_gap_names_a_judged_pair(tmp_path: Path):
    path = tmp_path / "gaps.toml"
    path.write_text(
        '[[gap]]\nlayout = "gemma"\nproblem = "escapes"\ntracked_by = "issue 35"\n'
        'why = "x"\npair = "base"\n'
    )
    with pytest.raises(GapsError, match="pair 'base'"):
        load_gaps(path)


def _by_hit(*cases: tuple[str, int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for hit, n in cases:
        out.setdefault(hit, []).append(n)
    return out


def test_a_base_decoder_is_judged_by_the_cases_the_base_pair_reads_right():
    shared = _by_hit(("0", 529), ("50", 545))
    base = _row("base", wrong_lengths=[529, 545], wrong_lengths_by_hit=shared)
    same = _row("overlay->base", wrong_lengths=[529, 545], wrong_lengths_by_hit=shared)
    verdict = judge(_sweep(base, _row("overlay"), same), [])
    assert verdict.exit_code == 0
    assert verdict.base_decoder_wrong == 2
    assert "2 wrong cases of base decoders where the base pair is wrong too" in (
        verdict.line()
    )
    # One more wrong case than the base pair (the same length at another hit).
    more = _by_hit(("0", 529), ("50", 545), ("50", 529))
    worse = _row("overlay->base", wrong_lengths=[529, 545], wrong_lengths_by_hit=more)
    verdict = judge(_sweep(base, _row("overlay"), worse), [])
    assert verdict.failures == [
        "gemma (overlay->base) reads wrong KV in 1 case where the base pair reads right"
    ]
    # Without the base pair in the run there is nothing to compare with.
    verdict = judge(_sweep(_row("overlay"), same), [])
    assert verdict.failures == ["gemma (overlay->base) reads wrong KV in 2 cases"]
    # An overlaid decoder is held to every case, whatever the base pair does.
    mixed = _row("base->overlay", wrong_lengths=[529], wrong_lengths_by_hit=shared)
    assert judge(_sweep(base, mixed), []).exit_code == 1


def test_bytes_base_decoder_wrong_only_where_the_base_pair_is_right():
    item = ConfigItem("gemma", "read", 1, 1, "LBNHC")
    shared = _by_hit(("0", 529))
    base = ConfigReport("base", item, cases=4, wrong_cases=1, wrong_lengths=shared)
    same = ConfigReport(
        "overlay->base", item, cases=4, wrong_cases=1, wrong_lengths=shared
    )
    report = BytesReport([529], [0.0], PAIRS, [base, same], 1.0)
    verdict = judge_bytes(report, [])
    assert verdict.exit_code == 0 and verdict.base_decoder_wrong == 1
    more = _by_hit(("0", 529), ("100", 17))
    worse = ConfigReport(
        "overlay->base", item, cases=4, wrong_cases=2, wrong_lengths=more
    )
    verdict = judge_bytes(BytesReport([529], [0.0], PAIRS, [base, worse], 1.0), [])
    assert verdict.failures == [
        "gemma read 1->1 LBNHC (overlay->base) wrong or stray bytes in 1 case where "
        "the base pair moves right"
    ]


def test_the_default_sweep_runs_every_pair_and_update_readme_both():
    from vllm_overlay.cli import build_parser
    from vllm_overlay.simulate.builds import parse_pairs

    args = build_parser().parse_args(["simulate"])
    assert [p.name for p in parse_pairs(args.variant)] == [
        "base",
        "overlay",
        "base->overlay",
        "overlay->base",
    ]


def test_a_gap_of_every_pair_covers_each_judged_pair():
    item = ConfigItem("kimi", "read", 1, 2, "LBNHC")
    rows = [
        ConfigReport(v, item, cases=4, error_cases=4, refused="heterogeneous-TP")
        for v in ("overlay", "base->overlay", "overlay->base")
    ]
    report = BytesReport([17], [0.0], PAIRS, rows, 1.0)
    only = KnownGap("kimi read 1->2", "errors", "issue 37", "x", "bytes")
    assert len(judge_bytes(report, [only]).failures) == 2
    every = KnownGap("kimi read 1->2", "errors", "issue 37", "x", "bytes", "all")
    verdict = judge_bytes(report, [every])
    assert verdict.exit_code == 0 and len(verdict.known) == 3


def test_a_fault_in_a_base_decoder_fails_only_where_the_base_pair_does_not():
    """A fault injected into vLLM's own decoder (overlay->base) escapes as
    it does with a base prefiller: the base decoder's, not the overlay's;
    one the base pair survives fails the run."""
    base = FaultReport("base", "llama", "short-table", cases=2, escapes=2)
    mixed = FaultReport("overlay->base", "llama", "short-table", cases=2, escapes=2)
    verdict = judge(_sweep(faults=[base, mixed]), [])
    assert verdict.exit_code == 0
    assert "1 fault row of base decoders failing as the base pair does" in (
        verdict.line()
    )
    served = FaultReport(
        "base", "llama", "short-table", cases=2, other_right=2, refused_local=2
    )
    verdict = judge(_sweep(faults=[served, mixed]), [])
    assert verdict.failures == [
        "llama short-table (overlay->base) an exception escapes the scheduler "
        "in 2 of 2 cases"
    ]
