"""`vllm-overlay removable`: a workaround is removable with its core patch
only when its named tests fail with it reverted and pass with it reverted
and the core patch applied; a workaround that does not revert, a proof that
cannot fail, and a core patch that does not fix it are each a "no". The
pytest runs are stood in for by a runner that reads the trees it is given."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from vllm_overlay.cli import main
from vllm_overlay.gate import cli as gate_cli
from vllm_overlay.gate.removable import (
    Inputs,
    Runner,
    load_removable,
    prove_all,
    prove_workaround,
    reverted_texts,
    workarounds,
)
from vllm_overlay.gate.reports import TestOutcome
from vllm_overlay.series.core_series import load_core_series
from vllm_overlay.series.diff import HunkError
from vllm_overlay.series.patch_series import Series, SeriesPatch
from vllm_overlay.series.pin import Pin
from vllm_overlay.tree.apply import overlay_texts
from vllm_overlay.tree.materialize import BaseSource

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
FIXED = "if num_external_computed_tokens and self.connector is not None"
# Each core patch's file and a line it adds.
CORE_FIXED = {
    "c001": (SCHEDULER, FIXED),
    "c002": (
        "vllm/v1/core/kv_cache_manager.py",
        "cdiv(num_computed_tokens, manager.block_size)",
    ),
    "c003": (
        SCHEDULER,
        "processed_computed_tokens = max(0, processed_computed_tokens - 1)",
    ),
    "c004": ("vllm/v1/kv_cache_interface.py", "compress_ratio: int | None = None"),
    "c005": (
        "vllm/v1/request.py",
        "self.num_local_hit_tokens_per_group: tuple[int, ...] | None = None",
    ),
    "c006": (SCHEDULER, "recovers_failed_sync_kv_loads = True"),
    "c007": (
        "vllm/v1/kv_cache_interface.py",
        "min_tokens_per_state: int | Fraction | None = field(",
    ),
}


@pytest.fixture(scope="module")
def inputs(pin: Pin, series: Series, base_texts: dict[str, str]) -> Inputs:
    core = load_core_series(series.root)
    return Inputs(series, core, base_texts, BaseSource().load_core(pin))


def _workaround(
    inputs: Inputs, number: str = "0010"
) -> tuple[SeriesPatch, SeriesPatch]:
    [(workaround, fix)] = [
        (w, f)
        for w, f in workarounds(inputs.series, inputs.core)
        if w.name.startswith(f"{number}-")
    ]
    return workaround, fix


def _has(files: dict[str, str], patch: SeriesPatch) -> bool:
    """Whether the tree holds the lines ``patch`` adds."""
    added = [
        text for fp in patch.files for h in fp.hunks for tag, text in h.lines
        if tag == "+" and text.strip()
    ]  # fmt: skip
    return all(any(a in t for t in files.values()) for a in added)


def _runner(
    inputs: Inputs, fails: str, number: str = "0010"
) -> tuple[Runner, list[str]]:
    """A runner whose tests fail on: "unfixed" a tree with a workaround
    reverted and not its core fix, "never", "reverted" any tree without it
    (the workaround run by ``number`` when it is not its core patch's)."""
    seen: list[str] = []
    pairs = workarounds(inputs.series, inputs.core)

    def run(
        files: dict[str, str], entries: Sequence[str], work: Path
    ) -> dict[str, TestOutcome]:
        workaround, fix = next(
            ((w, f) for w, f in pairs if work.name.startswith(w.name[:4])),
            _workaround(inputs, number),
        )
        fix_path, fix_line = CORE_FIXED[fix.name[:4]]
        fixed = fix_line in files[fix_path]
        kept = _has(files, workaround)
        seen.append(f"{work.name}: {'fixed' if fixed else 'unfixed'}")
        core = {k: line in files[path] for k, (path, line) in CORE_FIXED.items()}
        key = next(
            (k for k in core if entries[0].startswith(f"tests/patches/core/test_{k}")),
            None,
        )
        if key is not None:
            bad = not core[key]
        else:
            bad = {"unfixed": not kept and not fixed, "never": False}.get(
                fails, not kept
            )
        return {e: "failed" if bad else "passed" for e in entries}

    return run, seen


def test_the_zeroing_workaround_is_removable_with_its_core_fix(
    inputs: Inputs, tmp_path: Path
) -> None:
    workaround, fix = _workaround(inputs)
    assert workaround.name.startswith("0010-") and fix.name.startswith("c001-")
    run, seen = _runner(inputs, "unfixed")
    verdict = prove_workaround(inputs, workaround, fix, run, tmp_path)
    assert verdict.line == "0010 removable with core patch c001: yes"
    assert seen == ["0010-reverted: unfixed", "0010-reverted-c001: fixed"]


def test_a_proof_that_cannot_fail_is_no(inputs: Inputs, tmp_path: Path) -> None:
    workaround, fix = _workaround(inputs)
    run, seen = _runner(inputs, "never")
    verdict = prove_workaround(inputs, workaround, fix, run, tmp_path)
    assert verdict.line == (
        "0010 removable with core patch c001: no (its tests pass with 0010 "
        "reverted and no core patch, so the proof cannot fail)"
    )
    assert len(seen) == 1


def test_a_core_patch_that_does_not_fix_it_is_no(
    inputs: Inputs, tmp_path: Path
) -> None:
    workaround, fix = _workaround(inputs)
    run, _ = _runner(inputs, "reverted")
    verdict = prove_workaround(inputs, workaround, fix, run, tmp_path)
    assert not verdict.removable
    assert verdict.line.startswith(
        "0010 removable with core patch c001: no (4 of 4 named tests fail with "
        "0010 reverted and c001 applied: "
    )


def test_a_workaround_that_does_not_revert_is_no(
    inputs: Inputs, tmp_path: Path
) -> None:
    workaround, fix = _workaround(inputs)
    below = Inputs(
        inputs.series.upto(workaround.index - 1),
        inputs.core,
        inputs.bases,
        inputs.core_bases,
    )
    run, seen = _runner(inputs, "unfixed")
    verdict = prove_workaround(below, workaround, fix, run, tmp_path)
    assert verdict.line.startswith(
        "0010 removable with core patch c001: no (does not revert: "
    )
    assert seen == []
    with pytest.raises(HunkError):
        reverted_texts(inputs.bases, workaround)


def test_a_change_a_patch_above_edits_around_is_merged_out(
    inputs: Inputs, tmp_path: Path
) -> None:
    """0036's hunk ends two lines above 0018's: reverse-applied, its context
    is not found on the whole series; merged out as `git revert` does, the
    tree is the whole series with 0036's lines as below it."""
    workaround, fix = _workaround(inputs, "0036")
    full = {**inputs.bases, **overlay_texts(inputs.bases, inputs.series)}
    levels = tuple(
        {**inputs.bases, **overlay_texts(inputs.bases, inputs.series.upto(k))}
        for k in (workaround.index - 1, workaround.index)
    )
    with pytest.raises(HunkError):
        reverted_texts(full, workaround)
    reverted = reverted_texts(full, workaround, (levels[0], levels[1]))
    [fp] = workaround.files
    [hunk] = fp.hunks
    removed = [text for tag, text in hunk.lines if tag == "-"]
    added = [text for tag, text in hunk.lines if tag == "+"]
    assert all(line in reverted[fp.path] for line in removed)
    assert not any(line in reverted[fp.path] for line in added if "cdiv" in line)
    run, seen = _runner(inputs, "unfixed", "0036")
    verdict = prove_workaround(inputs, workaround, fix, run, tmp_path)
    assert verdict.line == "0036 removable with core patch c002: yes"
    assert seen == ["0036-reverted: unfixed", "0036-reverted-c002: fixed"]


def test_every_core_patch_is_red_without_it_and_green_with_it(
    inputs: Inputs,
) -> None:
    run, _ = _runner(inputs, "unfixed")
    report = prove_all(inputs, run, "0.34.0", progress=lambda line: None)
    assert report.core_rows and all(r.holds for r in report.core_rows)
    assert [v.line for v in report.verdicts] == [
        "0036 removable with core patch c002: yes",
        "0006 removable with core patch c005: yes",
        "0048 removable with core patch c003: yes",
        "0010 removable with core patch c001: yes",
        "0051 removable with core patch c003: yes",
        "0054 removable with core patch c007: yes",
        "0057 removable with core patch c004: yes",
    ]


def test_proofs_run_side_by_side_and_keep_the_series_order(inputs: Inputs) -> None:
    """With two jobs, two proofs' pytest runs are in flight at once (each
    of the first two waits for the other), and the rows and verdicts come
    back in the series' order whatever finishes first."""
    run, seen = _runner(inputs, "unfixed")
    both = threading.Barrier(2, timeout=60)
    calls = iter(range(10_000))

    def paired(
        files: dict[str, str], entries: Sequence[str], work: Path
    ) -> dict[str, TestOutcome]:
        if next(calls) < 2:
            both.wait()
        return run(files, entries, work)

    report = prove_all(inputs, paired, "0.34.0", progress=lambda line: None, jobs=2)
    assert not both.broken
    assert [r.core[:4] for r in report.core_rows] == sorted(
        r.core[:4] for r in report.core_rows
    )
    assert [v.line for v in report.verdicts] == [
        "0036 removable with core patch c002: yes",
        "0006 removable with core patch c005: yes",
        "0048 removable with core patch c003: yes",
        "0010 removable with core patch c001: yes",
        "0051 removable with core patch c003: yes",
        "0054 removable with core patch c007: yes",
        "0057 removable with core patch c004: yes",
    ]
    assert len(seen) == 2 * (len(inputs.core.patches) + len(report.verdicts))


def test_the_command_prints_the_verdicts_and_sets_the_status(
    inputs: Inputs,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for fails, status in (("unfixed", 0), ("never", 1)):
        run, _ = _runner(inputs, fails)
        monkeypatch.setattr(gate_cli, "pytest_runner", lambda *a, run=run: run)
        out = tmp_path / f"{fails}.json"
        assert main(["removable", "--out", str(out)]) == status
        lines = capsys.readouterr().out.splitlines()
        verdict = next(ln for ln in lines if ln.startswith("0010 removable"))
        assert verdict.startswith(
            "0010 removable with core patch c001: " + ("yes" if not status else "no")
        )
        assert lines[-1].startswith(
            "removable: ok, 7 of 7 workaround" if not status else "removable: FAILED"
        )
        report = load_removable(out)
        assert [v.removable for v in report.verdicts] == [not status] * 7
        assert json.loads(out.read_text())["core_rows"][0]["with"] == "passed"


def test_an_unknown_workaround_is_one_line_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def never(*a: object) -> Runner:
        raise AssertionError("nothing may run")

    monkeypatch.setattr(gate_cli, "pytest_runner", never)
    assert main(["removable", "--patch", "0009"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --patch 0009: not a patch whose Remove-When names a core patch "
        "(those are: 0036, 0006, 0048, 0010, 0051, 0054, 0057)\n"
    )
