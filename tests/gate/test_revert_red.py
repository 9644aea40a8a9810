"""The unit-base gate: each patch's Tests fail on the stack below it and pass
with it; its Guards pass on both."""

from __future__ import annotations

import json
from pathlib import Path

from tests.workspace import ANCHOR, CONNECTOR, Workspace, replace_once
from vllm_overlay.cli import main
from vllm_overlay.gate.outcomes import load_outcomes
from vllm_overlay.gate.reports import load_revert_red
from vllm_overlay.gate.revert_red import (
    build_report,
    format_table,
    gate,
    series_level_note,
)
from vllm_overlay.gate.stack import level_plan, run_levels
from vllm_overlay.series.patch_series import Series, load_series
from vllm_overlay.series.pin import load_pin

PROBE = "tests/test_probe.py"
# The probe test reads the connector the MoRIIO package loads from: test
# "has_a" passes once patch 0001's marker is there, and so on.
PROBE_TEXT = """
from pathlib import Path

import vllm.distributed.kv_transfer.kv_connector.v1.moriio as moriio


def _connector() -> str:
    return (Path(moriio.__path__[0]) / "moriio_connector.py").read_text()


def test_has_a():
    assert "# marker-a" in _connector()


def test_has_b():
    assert "# marker-b" in _connector()


def test_has_c():
    assert "# marker-c" in _connector()


def test_has_no_d():
    assert "# marker-d" not in _connector()
"""


def _stack(ws: Workspace, guards: dict[str, str] | None = None) -> Series:
    """Three patches, each adding a marker line above the previous one's and
    naming the probe test for it (0002 also guards the probe of 0001)."""
    guards = guards if guards is not None else {"b": f"{PROBE}::test_has_a"}
    text = ws.base[CONNECTOR]
    for number, tag in enumerate("abc", 1):
        name = f"000{number}-{tag}.patch"
        text = ws.patch_from_edit(
            name,
            CONNECTOR,
            lambda t, tag=tag: replace_once(t, ANCHOR, f"# marker-{tag}\n{ANCHOR}"),
            on=text,
        )
        path = ws.repo / "patches" / name
        header_tests = f"Tests: {PROBE}::test_has_{tag}"
        if tag in guards:
            header_tests += f"\nGuards: {guards[tag]}"
        path.write_text(
            path.read_text().replace("Tests: tests/conftest.py", header_tests)
        )
    (ws.repo / PROBE).write_text(PROBE_TEXT)
    return load_series(ws.repo)


def _levels(holding: dict[int, dict[str, str]]) -> dict[int, dict[str, str]]:
    return {
        k: {f"{PROBE}::{name}": outcome for name, outcome in tests.items()}
        for k, tests in holding.items()
    }


# Each probe test as the markers make it: has_X fails below X's patch.
TRUE_LEVELS = _levels(
    {
        0: {"test_has_a": "failed", "test_has_b": "failed", "test_has_c": "failed"},
        1: {"test_has_a": "passed", "test_has_b": "failed"},
        2: {"test_has_a": "passed", "test_has_b": "passed", "test_has_c": "failed"},
        3: {"test_has_a": "passed", "test_has_b": "passed", "test_has_c": "passed"},
    }
)


def _report(series: Series, levels: dict[int, dict[str, str]]):
    return build_report(
        series,
        "0.33.0",
        base=levels[0],
        overlay=levels[3],
        levels={k: levels[k] for k in (1, 2)},
    )


def test_gate_holds_patch_by_patch(ws: Workspace) -> None:
    series = _stack(ws)
    report = _report(series, TRUE_LEVELS)
    assert gate(report, series) == []
    rows = [(r.test_id.split("::")[1], r.patch, r.role, r.below, r.with_)
            for r in report.stack]  # fmt: skip
    assert rows == [
        ("test_has_a", "0001-a.patch", "test", "failed", "passed"),
        ("test_has_b", "0002-b.patch", "test", "failed", "passed"),
        ("test_has_a", "0002-b.patch", "guard", "passed", "passed"),
        ("test_has_c", "0003-c.patch", "test", "failed", "passed"),
    ]
    table = format_table(report).splitlines()
    assert table[0].split() == ["test", "id", "patch", "role", "below", "with"]
    assert table[3].split() == [f"{PROBE}::test_has_a", "0002", "guard", "passed",
                                "passed"]  # fmt: skip


def test_a_test_that_an_earlier_patch_makes_pass_does_not_prove_its_patch(
    ws: Workspace,
) -> None:
    """Failing on the base is not enough: patch 0003's test already passes
    with 0001..0002 applied, so 0003 is not what makes it pass."""
    series = _stack(ws)
    levels = {k: dict(v) for k, v in TRUE_LEVELS.items()}
    levels[2][f"{PROBE}::test_has_c"] = "passed"
    assert gate(_report(series, levels), series) == [
        f"0003-c.patch: {PROBE}::test_has_c passes on base + 0001..0002, so it "
        "does not prove the patch is needed"
    ]


def test_failing_with_the_patch_and_broken_guards_are_reported(
    ws: Workspace,
) -> None:
    series = _stack(ws, {"b": f"{PROBE}::test_has_a", "c": f"{PROBE}::test_has_b"})
    levels = {k: dict(v) for k, v in TRUE_LEVELS.items()}
    levels[1][f"{PROBE}::test_has_a"] = "error"  # 0001's test, with 0001
    levels[2][f"{PROBE}::test_has_b"] = "failed"  # 0002's test and 0003's guard
    assert gate(_report(series, levels), series) == [
        f"0001-a.patch: {PROBE}::test_has_a error on base + 0001",
        f"0002-b.patch: {PROBE}::test_has_b failed on base + 0001..0002",
        f"0002-b.patch: guard {PROBE}::test_has_a is error on base + 0001 and "
        "passed on base + 0001..0002; a guard passes on both",
        f"0003-c.patch: guard {PROBE}::test_has_b is failed on base + 0001..0002 "
        "and passed on base + 0001..0003; a guard passes on both",
    ]


def test_named_tests_not_run_are_reported(ws: Workspace) -> None:
    series = _stack(ws)
    report = build_report(series, "0.33.0", base={}, overlay={})
    assert gate(report, series) == [
        "no test ran",
        f"0001-a.patch: {PROBE}::test_has_a was not run",
        f"0002-b.patch: {PROBE}::test_has_b was not run",
        f"0002-b.patch: {PROBE}::test_has_a was not run",
        f"0003-c.patch: {PROBE}::test_has_c was not run",
    ]


def test_unnamed_failure_with_the_overlay_fails_the_gate(ws: Workspace) -> None:
    series = _stack(ws)
    levels = {k: dict(v) for k, v in TRUE_LEVELS.items()}
    levels[0]["t::x"] = "passed"
    levels[3]["t::x"] = "failed"
    assert gate(_report(series, levels), series) == ["t::x failed with the overlay"]


def test_whole_series_checks_red_on_the_base_are_one_line_not_a_warning(
    ws: Workspace, tmp_path: Path, capsys
) -> None:
    """Tests no patch names that fail on the base and pass with the series
    (the simulator's checks of the installed overlay) are expected: one line
    that says so, per file, and the gate is ok."""
    series = _stack(ws)
    levels = {k: dict(v) for k, v in TRUE_LEVELS.items()}
    for n in range(3):
        levels[0][f"tests/simulate/test_x.py::test_{n}"] = "failed"
        levels[3][f"tests/simulate/test_x.py::test_{n}"] = "passed"
    levels[0]["tests/other.py::test_y"] = "error"
    levels[3]["tests/other.py::test_y"] = "passed"
    report = _report(series, levels)
    assert gate(report, series) == []
    assert series_level_note(report) == (
        "also expected: 4 tests of the whole series (named by no patch) fail on "
        "the base and pass with the series: tests/other.py (1), "
        "tests/simulate/test_x.py (3)"
    )
    assert series_level_note(_report(series, TRUE_LEVELS)) == ""
    paths = {}
    for k, outcomes in levels.items():
        paths[k] = tmp_path / f"outcomes-level-{k}.json"
        paths[k].write_text(json.dumps({"outcomes": outcomes}))
    args = ["--base-outcomes", str(paths[0]), "--overlay-outcomes", str(paths[3])]
    args += ["--levels", str(tmp_path), "--out", str(tmp_path / "r.json")]
    assert main(["--repo", str(ws.repo), "revert-red", *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == series_level_note(report)
    assert out[-1].startswith("revert-red: ok;")
    assert not [line for line in out if "test_x.py::" in line]


def test_level_plan_runs_each_patch_below_and_with(ws: Workspace) -> None:
    series = _stack(ws)
    assert level_plan(series) == {
        1: [f"{PROBE}::test_has_a", f"{PROBE}::test_has_b"],
        2: [f"{PROBE}::test_has_b", f"{PROBE}::test_has_a", f"{PROBE}::test_has_c"],
    }


def test_levels_run_against_the_materialized_stack(
    ws: Workspace, tmp_path: Path
) -> None:
    """The real run: each intermediate level's MoRIIO package is written out
    and pytest loads vLLM's MoRIIO package from it."""
    series = _stack(ws)
    pin = load_pin(ws.repo / "pin.toml")
    lines: list[str] = []
    written = run_levels(
        ws.repo, pin, series, ws.base, tmp_path / "levels", progress=lines.append
    )
    assert sorted(written) == [1, 2]
    assert load_outcomes(written[1]) == {
        f"{PROBE}::test_has_a": "passed",
        f"{PROBE}::test_has_b": "failed",
    }
    assert load_outcomes(written[2]) == {
        f"{PROBE}::test_has_a": "passed",
        f"{PROBE}::test_has_b": "passed",
        f"{PROBE}::test_has_c": "failed",
    }
    # vLLM loaded once, then each level forked from that process.
    assert lines[0].startswith("levels: vLLM loaded once (")
    assert any(
        line.startswith("level 1/3 (base + 0001): 2 named tests of 0001-a")
        for line in lines
    )
    level_1 = [line for line in lines if line.startswith("  level 1: ")]
    assert len(level_1) == 1 and "1 failed, 1 passed" in level_1[0]


def test_level_without_a_named_test_stops_the_run(
    ws: Workspace, tmp_path: Path
) -> None:
    series = _stack(ws, {"b": f"{PROBE}::test_missing"})
    pin = load_pin(ws.repo / "pin.toml")
    try:
        run_levels(ws.repo, pin, series, ws.base, tmp_path / "levels", progress=print)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        assert "level 1 (base + 0001): pytest exited 4" in str(e)
    else:
        raise AssertionError("a missing named test must stop the run")


def test_cli_writes_the_report(ws: Workspace, tmp_path: Path, capsys) -> None:
    series = _stack(ws)
    paths = {}
    for k, outcomes in TRUE_LEVELS.items():
        paths[k] = tmp_path / f"outcomes-level-{k}.json"
        paths[k].write_text(json.dumps({"outcomes": outcomes}))
    out = tmp_path / "report.json"
    args = ["--base-outcomes", str(paths[0]), "--overlay-outcomes", str(paths[3])]
    args += ["--levels", str(tmp_path), "--out", str(out)]
    assert main(["--repo", str(ws.repo), "revert-red", *args]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(
        "revert-red: ok; 3/3 named tests fail on the stack below their patch and "
        "pass with it, 1/1 guards pass on both;"
    )
    report = load_revert_red(out)
    assert report.series_id == series.series_id
    assert [r.holds for r in report.stack] == [True] * 4
    paths[2].unlink()
    assert main(["--repo", str(ws.repo), "revert-red", *args]) == 2
    assert "no outcomes for stack level 2" in capsys.readouterr().err
