"""The byte simulator's verdict: exit status 1 when an overlay configuration
that starts moves a wrong or stray byte, crashes, is refused at its first
transfer or runs no case, unless a bytes-scoped known gap lists it."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_overlay.simulate.bytes.report import BytesReport, ConfigItem, ConfigReport
from vllm_overlay.simulate.bytes.verdict import judge, names
from vllm_overlay.simulate.verdict import GAPS_FILE, KnownGap, load_gaps

REPO = Path(__file__).resolve().parents[3]
GLM = ConfigItem("glm", "read", 1, 2, "LBNHC")
LLAMA = ConfigItem("llama", "read", 1, 1, "LBNHC")


def _config(item: ConfigItem, variant: str = "overlay", **kw: object) -> ConfigReport:
    return ConfigReport(variant=variant, item=item, **kw)  # type: ignore[arg-type]


def _report(*configs: ConfigReport) -> BytesReport:
    return BytesReport([2], [0.0], {"base": "b", "overlay": "o"}, list(configs), 1.0)


def _gap(layout: str, problem: str = "errors", scope: str = "bytes") -> KnownGap:
    return KnownGap(layout, problem, "issue 37", "unequal TP", scope)  # type: ignore[arg-type]


def test_right_bytes_pass() -> None:
    verdict = judge(_report(_config(LLAMA, cases=3)), [])
    assert verdict.exit_code == 0
    assert verdict.line().startswith("simulate-bytes: ok:")


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"cases": 3, "wrong_cases": 1}, "wrong or stray bytes in 1 of 3 cases"),
        ({"cases": 3, "error_cases": 2}, "crashes in 2 of 3 cases"),
        ({"cases": 3, "error_cases": 3, "refused": "MoRIIOError: x"}, "first transfer"),
        ({"cases": 0}, "ran no case"),
    ],
)
def test_each_problem_fails(fields: dict[str, object], problem: str) -> None:
    verdict = judge(_report(_config(LLAMA, cases=3), _config(GLM, **fields)), [])
    assert verdict.exit_code == 1
    assert problem in verdict.line() and "glm read 1->2 LBNHC" in verdict.line()


def test_the_base_is_not_judged() -> None:
    base = _config(GLM, variant="base", cases=3, wrong_cases=3)
    assert judge(_report(base, _config(LLAMA, cases=3)), []).exit_code == 0


def test_refused_at_start_is_no_failure_unless_nothing_ran() -> None:
    refused = _config(GLM, refused_at_start="NotImplementedError: no")
    assert judge(_report(refused, _config(LLAMA, cases=1)), []).exit_code == 0
    verdict = judge(_report(refused), [])
    assert verdict.exit_code == 1 and "no case ran" in verdict.line()


@pytest.mark.parametrize("name", names(GLM))
def test_a_bytes_gap_names_the_layout_or_the_configuration(name: str) -> None:
    failing = _config(GLM, cases=3, error_cases=3, refused="NotImplementedError: TP")
    verdict = judge(_report(failing), [_gap(name)])
    assert verdict.exit_code == 0 and verdict.known


def test_a_gap_of_another_problem_scope_or_configuration_does_not_hide() -> None:
    failing = _config(GLM, cases=3, wrong_cases=1)
    for gap in (
        _gap("glm", "errors"),
        _gap("glm", "wrong KV", scope="scheduler"),
        _gap("glm read 2->1", "wrong KV"),
    ):
        assert judge(_report(failing), [gap]).exit_code == 1, gap


def test_the_gaps_file_reads_and_names_known_layouts() -> None:
    gaps = [g for g in load_gaps(REPO / GAPS_FILE) if g.scope == "bytes"]
    assert gaps and all(g.tracked_by.startswith("issue ") for g in gaps)


def _mixed(*configs: ConfigReport, base: bool = False) -> BytesReport:
    variants = {"base->overlay": "bo", "overlay->base": "ob"}
    variants |= {"base": "b"} if base else {}
    return BytesReport([2], [0.0], variants, list(configs), 1.0)


def _wrong(variant: str) -> ConfigReport:
    return _config(GLM, variant, cases=3, wrong_cases=1, wrong_lengths={"0": [17]})


def test_a_base_decoder_without_the_base_pair_is_not_judged_a_failure() -> None:
    """``--variant mixed`` alone: the wrong bytes of the base decoder may be
    vLLM's own; the line says they cannot be judged without base."""
    verdict = judge(_mixed(_wrong("overlay->base"), _config(LLAMA, cases=3)), [])
    line = verdict.line()
    assert verdict.exit_code == 0 and "FAILED" not in line, line
    assert "cannot judge 1 configuration of base decoders" in line
    assert "without the base pair" in line and "(overlay->base)" in line
    assert "\n" not in line


def test_a_base_decoder_is_judged_against_the_base_pair_when_it_ran() -> None:
    shared = _mixed(_wrong("overlay->base"), _wrong("base"), base=True)
    assert judge(shared, []).exit_code == 0
    right = _config(GLM, "base", cases=3)
    verdict = judge(_mixed(_wrong("overlay->base"), right, base=True), [])
    assert verdict.exit_code == 1 and "where the base pair moves right" in (
        verdict.line()
    )


def test_an_overlaid_decoder_of_a_mixed_run_is_still_judged() -> None:
    verdict = judge(_mixed(_wrong("base->overlay")), [])
    assert verdict.exit_code == 1 and "(base->overlay)" in verdict.line()


def test_a_sweep_without_faults_counts_no_failed_fault_case_of_the_base() -> None:
    """The base pair's wrong cases of a plain sweep are shown as what the
    base decoders share, not as failed fault cases."""
    report = _mixed(_wrong("overlay->base"), _wrong("base"), base=True)
    line = judge(report, []).line()
    assert "fault case" not in line and "base pair is wrong too" in line, line
