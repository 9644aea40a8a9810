"""The unit-base gate: named tests must fail on the base and pass overlaid."""

from __future__ import annotations

import json
from pathlib import Path

from tests.overlay.workspace import ANCHOR, CONNECTOR, Workspace, replace_once
from vllm_overlay.cli import main
from vllm_overlay.gate.reports import load_revert_red
from vllm_overlay.gate.revert_red import build_report, gate
from vllm_overlay.series.patch_series import load_series

NAMED = "tests/overlay/conftest.py::test_fix"


def _series(ws: Workspace):
    ws.patch_from_edit(
        "0001-a.patch", CONNECTOR, lambda t: replace_once(t, ANCHOR, "#\n" + ANCHOR)
    )
    path = ws.repo / "patches" / "0001-a.patch"
    path.write_text(
        path.read_text().replace("Tests: tests/overlay/conftest.py", f"Tests: {NAMED}")
    )
    return load_series(ws.repo)


def test_gate_holds_for_a_revert_red_test(ws: Workspace) -> None:
    series = _series(ws)
    report = build_report(
        series,
        "0.33.0",
        {NAMED + "[1]": "failed", NAMED + "[2]": "error", "t::other": "passed"},
        {NAMED + "[1]": "passed", NAMED + "[2]": "passed", "t::other": "passed"},
    )
    assert gate(report, series) == []
    assert {r.test_id: r.patch for r in report.rows} == {
        NAMED + "[1]": "0001-a.patch",
        NAMED + "[2]": "0001-a.patch",
        "t::other": "",
    }


def test_gate_fails_when_named_test_passes_on_base_or_fails_overlaid(
    ws: Workspace,
) -> None:
    series = _series(ws)
    report = build_report(
        series,
        "0.33.0",
        {NAMED: "passed", "t::x": "passed"},
        {NAMED: "failed", "t::x": "failed"},
    )
    problems = gate(report, series)
    assert problems == [
        f"0001-a.patch: {NAMED} passes on the base, so it does not prove the "
        "patch is needed",
        f"0001-a.patch: {NAMED} failed with the overlay",
        "t::x failed with the overlay",
    ]


def test_gate_fails_when_named_test_did_not_run(ws: Workspace) -> None:
    series = _series(ws)
    report = build_report(series, "0.33.0", {}, {})
    assert gate(report, series) == ["no test ran", f"0001-a.patch: {NAMED} was not run"]


def test_cli_writes_the_report(ws: Workspace, tmp_path: Path, capsys) -> None:
    _series(ws)
    base, overlay = tmp_path / "b.json", tmp_path / "o.json"
    base.write_text(json.dumps({"outcomes": {NAMED: "failed"}}))
    overlay.write_text(json.dumps({"outcomes": {NAMED: "passed"}}))
    out = tmp_path / "report.json"
    args = ["--base-outcomes", str(base), "--overlay-outcomes", str(overlay)]
    assert main(["--repo", str(ws.repo), "revert-red", *args, "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("revert-red: ok; 1/1")
    report = load_revert_red(out)
    assert report.rows[0].revert_red
