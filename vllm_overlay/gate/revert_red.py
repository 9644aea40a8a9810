"""The revert-red table and its gate.

Every test of the suite runs on the pinned base and with the whole series.
Every test a patch names runs on the stack below the patch and on the stack
with it: patch K's `Tests` fail with patches 1..K-1 applied and pass with
1..K; its `Guards` pass on both.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import TypeAlias

from vllm_overlay.gate.evidence import Selection, Touches
from vllm_overlay.gate.reports import (
    RevertRedReport,
    RevertRedRow,
    StackRow,
    TestOutcome,
    names,
)
from vllm_overlay.gate.stack import level_label, named_tests
from vllm_overlay.series.patch_series import Series
from vllm_overlay.text import count, verb

NOT_RUN: TestOutcome = "not run"
# Test id -> outcome, for one run of the suite.
Outcomes: TypeAlias = Mapping[str, TestOutcome]


def _named_by(series: Series, test_id: str) -> str:
    for patch in series.patches:
        for named in patch.header.tests:
            if names(named, test_id):
                return patch.name
    return ""


def _stack_rows(series: Series, levels: Mapping[int, Outcomes]) -> list[StackRow]:
    rows: list[StackRow] = []
    for k, patch in enumerate(series.patches, 1):
        below, with_ = levels.get(k - 1, {}), levels.get(k, {})
        guards = set(patch.header.guards)
        for named in named_tests(patch):
            ids = sorted({i for i in (*below, *with_) if names(named, i)})
            rows.extend(
                StackRow(
                    test_id=i,
                    patch=patch.name,
                    role="guard" if named in guards else "test",
                    below=below.get(i, NOT_RUN),
                    with_=with_.get(i, NOT_RUN),
                )
                for i in ids
            )
    return rows


def build_report(
    series: Series,
    vllm_version: str,
    *,
    base: Outcomes,
    overlay: Outcomes,
    levels: Mapping[int, Outcomes] | None = None,
    not_run: frozenset[str] = frozenset(),
) -> RevertRedReport:
    """``base`` and ``overlay``: the suite on the pinned base and with the
    whole series; ``levels``: the named tests on each intermediate stack
    level K (patches 1..K applied); ``not_run``: the tests the base run left
    out on the evidence (`evidence_problems`), "not run" there, where
    another missing outcome is an error."""
    rows = [
        RevertRedRow(
            test_id=test_id,
            patch=_named_by(series, test_id),
            base=base.get(test_id, NOT_RUN if test_id in not_run else "error"),
            overlay=overlay.get(test_id, "error"),
        )
        for test_id in sorted(set(base) | set(overlay))
    ]
    all_levels = {**(levels or {}), 0: base, len(series.patches): overlay}
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return RevertRedReport(
        vllm_version, series.series_id, now, rows, _stack_rows(series, all_levels)
    )


def gate(report: RevertRedReport, series: Series) -> list[str]:
    """Every way the report falls short, one line each (empty: it holds)."""
    problems = [] if report.rows else ["no test ran"]
    for k, patch in enumerate(series.patches, 1):
        below, with_ = level_label(series, k - 1), level_label(series, k)
        rows = report.stack_for(patch.name)
        for named in named_tests(patch):
            if not [r for r in rows if names(named, r.test_id)]:
                problems.append(f"{patch.name}: {named} was not run")
        for r in rows:
            if r.holds:
                continue
            if r.role == "guard":
                problems.append(
                    f"{patch.name}: guard {r.test_id} is {r.below} on {below} and "
                    f"{r.with_} on {with_}; a guard passes on both"
                )
            elif r.below == "passed":
                problems.append(
                    f"{patch.name}: {r.test_id} passes on {below}, so it does not "
                    "prove the patch is needed"
                )
            elif r.below in ("failed", "error"):
                problems.append(f"{patch.name}: {r.test_id} {r.with_} on {with_}")
            else:
                problems.append(
                    f"{patch.name}: {r.test_id} is {r.below} on {below} and "
                    f"{r.with_} on {with_}"
                )
    problems.extend(
        f"{row.test_id} {row.overlay} with the overlay"
        for row in report.rows
        if not row.patch and row.overlay in ("failed", "error")
    )
    return problems


def evidence_problems(
    touches: Touches, selection: Selection, *, base: Outcomes, overlay: Outcomes
) -> list[str]:
    """Every way the base run's selection falls short of its evidence, one
    line each: a test with the overlay without evidence, a test that may read
    vLLM's MoRIIO package without a base outcome, or a sampled test that reads
    nothing there yet changes outcome between base and overlay."""
    problems = [
        f"{t} ran with the overlay but has no evidence of what it reads"
        for t in sorted(set(overlay) - set(touches.tests))
    ]
    touched = sorted(t for t, why in touches.tests.items() if why)
    if sorted(selection.touched) != touched:
        missing = sorted(set(touched) - set(selection.touched))
        problems.append(
            f"the selection leaves out {count(len(missing), 'test')} that may "
            f"read vLLM's MoRIIO package: {', '.join(missing[:5])}"
        )
    problems.extend(
        f"{t} may read vLLM's MoRIIO package ({'; '.join(touches.tests[t][:2])}) "
        "but did not run on the base"
        for t in touched
        if t not in base
    )
    for t in selection.sample:
        if touches.tests.get(t):
            problems.append(f"sample {t} reads vLLM's MoRIIO package")
        elif base.get(t, NOT_RUN) != overlay.get(t, NOT_RUN):
            problems.append(
                f"{t} reads nothing of vLLM's MoRIIO package with the overlay, "
                f"yet is {base.get(t, NOT_RUN)} on the base and "
                f"{overlay.get(t, NOT_RUN)} with the overlay: the evidence "
                "missed a dependence"
            )
    return problems


def series_level_note(report: RevertRedReport) -> str:
    """One line for the tests no patch names that fail on the base and pass
    with the series (checks of the whole series, such as the simulator's on
    the installed overlay): expected, and not gated per patch. "" if none.
    Those failing with the series are gate problems, not counted here."""
    rows = [
        r
        for r in report.rows
        if not r.patch and r.base in ("failed", "error") and r.overlay == "passed"
    ]
    if not rows:
        return ""
    files: dict[str, int] = {}
    for r in rows:
        path = r.test_id.split("::", 1)[0]
        files[path] = files.get(path, 0) + 1
    where = ", ".join(f"{path} ({n})" for path, n in files.items())
    return (
        f"also expected: {count(len(rows), 'test')} of the whole series (named "
        f"by no patch) {verb(len(rows), 'fails', 'fail')} on the base and "
        f"{verb(len(rows), 'passes', 'pass')} with the series: {where}"
    )


def format_table(report: RevertRedReport) -> str:
    """The per-patch table: each named test on the stack below its patch and
    on the stack with it."""
    rows = report.stack
    width = max((len(r.test_id) for r in rows), default=10)
    lines = [f"{'test id':<{width}}  {'patch':<5}  {'role':<5}  {'below':<7}  with"]
    for r in rows:
        patch = r.patch.split("-", 1)[0]
        lines.append(
            f"{r.test_id:<{width}}  {patch:<5}  {r.role:<5}  {r.below:<7}  {r.with_}"
        )
    return "\n".join(lines)
