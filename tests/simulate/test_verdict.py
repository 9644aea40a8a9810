"""The simulator's verdict: exit status 1 when the overlay reads wrong KV,
crashes or runs no case in a layout the known-gaps file does not list."""

from __future__ import annotations

import argparse
import io
import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from vllm_overlay.cli import build_parser, main
from vllm_overlay.command import PROGRESS_EVERY, App
from vllm_overlay.simulate import procs
from vllm_overlay.simulate.cli import report_name, selection
from vllm_overlay.simulate.eta import duration
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.simulate.report import (
    TABLE_WIDTH,
    LayoutReport,
    SweepReport,
    clip,
    format_table,
    summary_line,
)
from vllm_overlay.simulate.verdict import (
    GAPS_FILE,
    GapsError,
    KnownGap,
    gap_layout,
    judge,
    load_gaps,
)

REPO = Path(__file__).resolve().parents[2]


def _row(layout: str, variant: str = "overlay", **kw: object) -> LayoutReport:
    r = LayoutReport(variant=variant, layout=layout, note="", **kw)  # type: ignore[arg-type]
    return r


def _report(*rows: LayoutReport, variants: tuple[str, ...] = ("base", "overlay")):
    return SweepReport("1-10", [0.0], {v: v for v in variants}, list(rows), 1.0)


def _gap(layout: str, problem: str = "wrong KV") -> KnownGap:
    return KnownGap(layout, problem, "issue 12", "the window's first block")  # type: ignore[arg-type]


def test_wrong_kv_crashes_and_no_case_with_the_overlay_fail() -> None:
    report = _report(
        _row("llama", lengths_tried=10, cases=10),
        _row("gemma", lengths_tried=10, cases=10, wrong_lengths=[3, 7]),
        _row("gemma", variant="base", lengths_tried=10, cases=10, wrong_lengths=[1]),
        _row("kimi", lengths_tried=10, cases=10, error_cases=2),
        _row("glm", lengths_tried=10),
        _row("dsv4", refused_at_start="MoRIIOError: no", refused_by="connector"),
    )
    verdict = judge(report, [])
    assert verdict.exit_code == 1
    assert verdict.failures == [
        "gemma reads wrong KV at 2 of 10 lengths",
        "kimi crashes in 2 of 10 cases",
        "glm ran no case",
    ]
    line = verdict.line()
    assert line.startswith("simulate: FAILED: the overlay falls short in 3 layouts")
    assert "\n" not in line


def test_a_listed_gap_is_known_and_a_gap_that_no_longer_shows_is_said() -> None:
    report = _report(
        _row("gemma", lengths_tried=10, cases=10, wrong_lengths=[3]),
        _row("llama", lengths_tried=10, cases=10),
        _row("dsv4", refused_at_start="MoRIIOError: no", refused_by="connector"),
    )
    verdict = judge(report, [_gap("gemma"), _gap("llama"), _gap("kimi")])
    assert verdict.exit_code == 0
    assert verdict.known == ["gemma wrong KV (issue 12)"]
    assert verdict.passing_gaps == ["llama (wrong KV)"]  # kimi did not run
    assert verdict.line() == (
        "simulate: ok: the overlay reads the right KV in every layout that starts "
        "(2 run, 1 refused at start); 1 known gap: gemma wrong KV (issue 12)"
    )
    # A gap covers its problem only.
    crash = _report(_row("gemma", lengths_tried=1, cases=1, error_cases=1))
    assert judge(crash, [_gap("gemma")]).exit_code == 1


def test_a_run_where_every_layout_is_refused_ran_no_case() -> None:
    refused = _row("gemma/dcp3", refused_at_start="ValidationError", refused_by="vllm")
    verdict = judge(_report(refused), [])
    assert verdict.failures == [
        "no case ran: every layout was refused at start (gemma/dcp3 by vllm)"
    ]
    base_only = _report(_row("llama", variant="base"), variants=("base",))
    assert judge(base_only, []).failures == ["the sweep ran no case"]
    base_ran = _report(_row("llama", variant="base", cases=3), variants=("base",))
    assert judge(base_ran, []).exit_code == 0


def test_the_known_gaps_file_names_real_layouts_and_trackers() -> None:
    gaps = load_gaps(REPO / GAPS_FILE)
    for g in gaps:
        assert expand([gap_layout(g)]), g.layout
        assert g.tracked_by.strip() and g.why.strip()


def test_a_bad_known_gaps_file_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "gaps.toml"
    bad.write_text('[[gap]]\nlayout = "gemma"\nproblem = "slow"\n')
    with pytest.raises(GapsError, match="invalid known-gaps file"):
        load_gaps(bad)
    bad.write_text(
        '[[gap]]\nlayout = "gemma"\nproblem = "wrong KV"\ntracked_by = ""\nwhy = "x"\n'
    )
    with pytest.raises(GapsError, match="tracked_by and why are required"):
        load_gaps(bad)
    assert load_gaps(tmp_path / "missing.toml") == []


def _checkout(tmp_path: Path, gaps: str) -> Path:
    """A checkout with the real pin and an empty series: its overlay is the
    pinned base, which reads wrong KV where the seeds say."""
    root = tmp_path / "checkout"
    (root / "patches").mkdir(parents=True)
    (root / "docs").mkdir()
    shutil.copy(REPO / "pin.toml", root / "pin.toml")
    (root / "patches" / "series").write_text("")
    (root / GAPS_FILE).write_text(gaps)
    return root


WorkerResults = dict[tuple[str, ...], list[Any]]


@pytest.fixture(scope="module")
def worker_results() -> WorkerResults:
    """What the simulator's worker processes reported, by selection: the
    tests of this file that run the same selection share one worker run."""
    return {}


# Where the checkout and the report are, which the workers do not read:
# every checkout here is the real pin with an empty series.
_NOT_THE_WORKERS = ("--repo", "--report")


def _simulate(recorded: WorkerResults, argv: list[str]) -> int:
    """``main(argv)``, whose worker processes run once per selection: run
    again, the command is handed their recorded results. Everything else it
    does (its plan and expected time, the report, the known gaps, the
    verdict) runs every time. One worker process (``--processes 1``): a case
    or two, not worth a second vLLM import."""
    key = tuple(
        a
        for i, a in enumerate(argv)
        if a not in _NOT_THE_WORKERS and (i == 0 or argv[i - 1] not in _NOT_THE_WORKERS)
    )
    real = procs.run_processes

    def run_processes(*args: Any, **kwargs: Any) -> None:
        tally: procs.Tally = args[4]
        if key in recorded:
            for result in recorded[key]:
                tally(result)
            return
        real(*args, **kwargs)
        recorded[key] = list(tally.results)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(procs, "run_processes", run_processes)
        return main(argv)


# One selection for the tests that run the simulator: a case per mode.
DSV4_251 = ["--layouts", "dsv4", "--lengths", "251", "--hits", "0"]
DSV4_251 += ["--variant", "overlay", "--processes", "1"]
DSV4_GAP = (
    '[[gap]]\nlayout = "dsv4"\nproblem = "wrong KV"\n'
    'tracked_by = "issue 12"\nwhy = "the test lists it"\n'
)


def test_the_command_exits_1_on_wrong_kv_and_0_when_the_gap_is_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], worker_results: WorkerResults
) -> None:
    """dsv4 at N=251 on the base: seed 001's window shifted by one block."""
    root = _checkout(tmp_path, "")
    report = tmp_path / "sim.json"
    argv = ["--repo", str(root), "simulate", *DSV4_251, "--report", str(report)]
    code = _simulate(worker_results, argv)
    assert code == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == (
        "simulate: FAILED: the overlay falls short in 1 layout: dsv4 reads "
        "wrong KV at 1 of 1 lengths"
    )
    assert json.loads(report.read_text())["layouts"][0]["wrong_lengths"] == [251]
    (root / GAPS_FILE).write_text(DSV4_GAP)
    code = _simulate(worker_results, argv)
    assert code == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .endswith("1 known gap: dsv4 wrong KV (issue 12)")
    )


def test_a_targeted_run_writes_its_own_report_and_keeps_the_full_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], worker_results: WorkerResults
) -> None:
    """A run given --layouts/--lengths/... writes a report named by its
    selection; the full run's .nox-reports/simulate.json stays as it was."""
    root = _checkout(tmp_path, DSV4_GAP)
    full = root / ".nox-reports" / "simulate.json"
    full.parent.mkdir()
    full.write_text('{"the": "full run"}\n')
    argv = ["--repo", str(root), "simulate", *DSV4_251]
    code = _simulate(worker_results, argv)
    assert code == 0
    written = full.with_name(
        "simulate.layouts-dsv4.lengths-251.hits-0.variant-overlay.json"
    )
    rows = json.loads(written.read_text())["layouts"]
    # Both modes by default (as simulate-bytes): a READ row, then WRITE's,
    # which the connector refuses at start for dsv4's sliding window.
    assert [(r["mode"], r["cases"]) for r in rows] == [("read", 1), ("write", 0)]
    assert rows[1]["refused_by"] == "connector"
    assert full.read_text() == '{"the": "full run"}\n'
    out, err = capsys.readouterr()
    assert (
        f"report: {written} (this selection's; the full run's is simulate.json)" in out
    )
    # Before it starts, the plan and its expected time; the next run of the
    # same selection is expected to take what this one took.
    plan = "simulate: 2 cases: 1 layout x 1 variant x 2 modes; expected about "
    assert err.startswith(plan)
    wall = json.loads(written.read_text())["wall_seconds"]
    code = _simulate(worker_results, argv)
    assert code == 0
    assert capsys.readouterr().err.startswith(
        f"{plan}{duration(wall)} (the last run of this selection took {duration(wall)})"
    )


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["simulate", *argv])


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        ((), "simulate.json"),
        (("--processes", "2", "--markdown"), "simulate.json"),
        (("--layouts", "glm"), "simulate.layouts-glm.json"),
        (
            ("--layouts", "kimi/dcp2", "--whole"),
            "simulate.layouts-kimi_dcp2.whole.json",
        ),
        (("--lengths", "1-4096/13"), "simulate.lengths-1-4096_13.json"),
        (("--layouts", "glm", "--core"), "simulate.layouts-glm.core.json"),
        (("--update-readme",), "simulate.families.json"),
        (("--bytes",), "simulate-bytes.json"),
        (("--bytes", "--layouts", "glm"), "simulate-bytes.layouts-glm.json"),
        (
            ("--bytes", "--tp", "1-1", "--all-hits", "--modes", "read"),
            "simulate-bytes.modes-read.tp-1-1.all-hits.json",
        ),
    ],
)
def test_report_names(argv: tuple[str, ...], name: str) -> None:
    args = _args(*argv)
    full = "simulate-bytes.json" if args.bytes else "simulate.json"
    assert report_name(full, selection(args)) == name
    if args.bytes:  # simulate-bytes names its reports as simulate --bytes did
        own = build_parser().parse_args(
            ["simulate-bytes", *(a for a in argv if a != "--bytes")]
        )
        assert report_name(full, selection(own)) == name


def test_a_long_selection_is_cut_and_hashed() -> None:
    lengths = ",".join(str(n) for n in range(1, 200))
    name = report_name("simulate.json", selection(_args("--lengths", lengths)))
    other = report_name(
        "simulate.json", selection(_args("--lengths", lengths + ",300"))
    )
    assert name.startswith("simulate.lengths-1,2,3,") and name.endswith(".json")
    assert len(name) <= len("simulate..json") + 80
    assert name != other


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_is_a_plain_line_now_and_then_off_a_terminal() -> None:
    now = [0.0]
    err = _Stream(tty=False)
    app = App(stderr=err, clock=lambda: now[0])
    for i in range(100):
        now[0] = i * PROGRESS_EVERY / 10
        app.progress(f"[{i}/100 done]")
    app.end_progress()
    lines = err.getvalue().splitlines()
    assert lines == [f"[{i}/100 done]" for i in range(0, 100, 10)]
    assert "\x1b" not in err.getvalue() and "\r" not in err.getvalue()


def test_progress_overwrites_itself_on_a_terminal_within_its_width(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    err = _Stream(tty=True)
    app = App(stderr=err, clock=lambda: 0.0)
    app.progress("a")
    app.progress("b" * 100)
    app.end_progress()
    assert err.getvalue() == "\r\x1b[Ka\r\x1b[K" + "b" * 39 + "\r\x1b[K"


def _full_sweep() -> SweepReport:
    """The last full model-family sweep (docs/supported-models.json)."""
    data = (REPO / "docs" / "supported-models.json").read_bytes()
    return msgspec.json.decode(data, type=SweepReport)


def test_the_table_fits_120_columns_and_cuts_no_word() -> None:
    report = _full_sweep()
    texts = [" ".join(t.split()) for r in report.layouts for t in (
        r.refused_at_start or "", *r.first_errors) if t]  # fmt: skip
    lines = format_table(report).splitlines()
    assert len(lines) == len(report.layouts) + 2
    assert max(len(line) for line in lines) <= TABLE_WIDTH
    clipped = [line for line in lines if line.endswith("...")]
    assert clipped, "the sweep holds long refusals: some notes are clipped"
    for line in clipped:
        note = line.split("  ")[-1].removesuffix("...")
        text = note.split(": ", 1)[1]  # after "refused by X" / "N errors"
        full = next(t for t in texts if t.startswith(text))
        assert full[len(text)] in " ,;:", (text, full)


def test_clip_cuts_after_a_whole_word() -> None:
    assert clip("Value error, Total number of heads", 18) == "Value error..."
    assert clip("short", 18) == "short"
    assert clip("a\n  b", 10) == "a b"
    assert clip("x" * 30, 10) == "xxxxxxx..."


def test_the_summary_says_one_case() -> None:
    report = SweepReport(
        lengths="5",
        hits=[0.0],
        variants={"overlay": "series"},
        layouts=[LayoutReport("overlay", "llama", "", cases=1, lengths_tried=1)],
        wall_seconds=1.0,
    )
    assert summary_line(report).startswith("1 case; overlay: ")


def test_a_write_row_is_judged_by_reads_rules_and_gaps_name_its_mode() -> None:
    """WRITE rows: wrong KV fails the run (exit 1), a READ gap of the layout
    does not cover its WRITE row, a gap naming ``layout write`` does."""
    read = _row("llama", cases=4, lengths_tried=1)
    write = _row(
        "llama",
        mode="write",
        cases=4,
        lengths_tried=1,
        wrong_cases=1,
        wrong_lengths=[5],
        wrong_lengths_by_hit={"0": [5]},
    )
    report = _report(read, write)
    verdict = judge(report, [_gap("llama")])
    assert verdict.exit_code == 1
    assert verdict.failures == ["llama write reads wrong KV at 1 of 1 lengths"]
    verdict = judge(report, [_gap("llama write")])
    assert verdict.exit_code == 0
    assert verdict.known == ["llama write wrong KV (issue 12)"]
    assert verdict.line().startswith(
        "simulate: ok: the overlay moves the right KV in every layout that starts "
        "(2 run, 0 refused at start)"
    )
    assert gap_layout(_gap("llama/dcp2 write")) == "llama/dcp2"
    # A WRITE row refused at start is no failure, as READ's.
    refused = _row(
        "glm",
        mode="write",
        refused_at_start="NotImplementedError: no",
        refused_by="connector",
    )
    assert judge(_report(read, refused), []).exit_code == 0


def test_the_table_and_the_summary_carry_the_mode_per_row() -> None:
    rows = [
        _row("llama", cases=2, lengths_tried=1, pages_read=4, min_pages=4),
        _row(
            "llama", mode="write", cases=2, lengths_tried=1, pages_read=9, min_pages=4
        ),
        _row(
            "glm",
            mode="write",
            refused_at_start="NotImplementedError: no WRITE",
            refused_by="connector",
        ),  # fmt: skip
    ]
    report = _report(*rows, variants=("overlay",))
    lines = format_table(report).splitlines()
    assert lines[0].split() == ["layout", "variant", "mode", "lengths", "wrong", "KV",
                                "moved/min", "note"]  # fmt: skip
    assert lines[2].split()[:3] == ["llama", "overlay", "read"]
    assert lines[3].split()[:3] == ["llama", "overlay", "write"]
    assert lines[3].split()[-3:] == ["9/4", "=", "2.25"]
    assert lines[4].split()[:4] == ["glm", "overlay", "write", "refused"]
    line = summary_line(report)
    assert "overlay: 0 layouts with wrong KV, 0 reading more than the minimum" in line
    assert (
        "overlay write: 0 layouts with wrong KV, 1 writing more than the minimum, "
        "0 with errors (0 with escapes), 1 refused at start"
    ) in line
    encoded = msgspec.json.decode(msgspec.json.encode(report), type=SweepReport)
    assert [r.mode for r in encoded.layouts] == ["read", "write", "write"]
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(
            msgspec.json.encode(report).replace(b'"write"', b'"push"'),
            type=SweepReport,
        )


def test_modes_are_the_scheduler_simulators_option_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_overlay.simulate import cli

    seen: list[object] = []

    def sweep(*args: object, **kwargs: object) -> SweepReport:
        seen.append(kwargs["modes"])
        return _report(_row("llama", cases=1, lengths_tried=1), variants=("overlay",))

    monkeypatch.setattr(cli, "run_sweep", sweep)
    report = tmp_path / "r.json"
    argv = ["simulate", "--layouts", "llama", "--variant", "overlay"]
    argv += ["--report", str(report)]
    assert main([*argv, "--modes", "write"]) == 0
    assert main(argv) == 0
    assert seen == [["write"], ["read", "write"]]
    capsys.readouterr()
    assert main([*argv, "--modes", "push"]) == 2
    assert capsys.readouterr().err == (
        "error: --modes 'push': unknown mode 'push'; choose from ['read', 'write']\n"
    )
    assert main([*argv, "--faults", "--modes", "write"]) == 2
    assert capsys.readouterr().err == (
        "error: --modes: --faults and --update-readme run READ only\n"
    )
    assert seen == [["write"], ["read", "write"]]
