"""The revert-red table: each test on the base and with the overlay, and the
gate that every test a patch names fails on the base and passes overlaid."""

from __future__ import annotations

import datetime as dt

from vllm_overlay.gate.reports import RevertRedReport, RevertRedRow, TestOutcome
from vllm_overlay.series.patch_series import Series


def _named_by(series: Series, test_id: str) -> str:
    for patch in series.patches:
        for named in patch.header.tests:
            if test_id == named or test_id.startswith(named + "["):
                return patch.name
    return ""


def build_report(
    series: Series,
    vllm_version: str,
    base: dict[str, TestOutcome],
    overlay: dict[str, TestOutcome],
) -> RevertRedReport:
    rows = [
        RevertRedRow(
            test_id=test_id,
            patch=_named_by(series, test_id),
            base=base.get(test_id, "error"),
            overlay=overlay.get(test_id, "error"),
        )
        for test_id in sorted(set(base) | set(overlay))
    ]
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return RevertRedReport(vllm_version, series.series_id, now, rows)


def gate(report: RevertRedReport, series: Series) -> list[str]:
    """Every way the report falls short, one line each (empty: it holds)."""
    problems = [] if report.rows else ["no test ran"]
    for patch in series.patches:
        for named in patch.header.tests:
            rows = report.rows_named(named)
            if not rows:
                problems.append(f"{patch.name}: {named} was not run")
            for r in rows:
                if r.base == "passed":
                    problems.append(
                        f"{patch.name}: {r.test_id} passes on the base, so it "
                        "does not prove the patch is needed"
                    )
                elif r.base == "skipped":
                    problems.append(f"{patch.name}: {r.test_id} skipped on the base")
                if r.overlay != "passed":
                    problems.append(
                        f"{patch.name}: {r.test_id} {r.overlay} with the overlay"
                    )
    for r in report.rows:
        if not r.patch and r.overlay in ("failed", "error"):
            problems.append(f"{r.test_id} {r.overlay} with the overlay")
    return problems


def format_table(report: RevertRedReport, *, only_named: bool = False) -> str:
    rows = [r for r in report.rows if r.patch or not only_named]
    width = max((len(r.test_id) for r in rows), default=10)
    lines = [f"{'test id':<{width}}  {'patch':<6}  {'base':<7}  overlay"]
    for r in rows:
        patch = r.patch.split("-", 1)[0] if r.patch else "-"
        lines.append(f"{r.test_id:<{width}}  {patch:<6}  {r.base:<7}  {r.overlay}")
    return "\n".join(lines)
