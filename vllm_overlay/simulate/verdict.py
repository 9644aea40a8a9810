"""The simulator's verdict on the overlay: one line and an exit status.

A layout that starts must read the right KV with the overlay, at every prompt
length and hit tried, without a crash, and run at least one case. A layout
refused at start (MoRIIO or vLLM failing closed) is no failure, unless every
layout of the run was: then no case ran at all. A layout that
falls short is a failure unless ``docs/known-gaps.toml`` lists it, for that
problem, with the issue or patch that tracks it. The base variant is not
judged: it is what the series fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.simulate.report import LayoutReport, SweepReport
from vllm_overlay.text import count
from vllm_overlay.tomlfile import read_toml

GAPS_FILE = Path("docs") / "known-gaps.toml"
SIMULATE_REPORT = "simulate.json"
Problem = Literal["wrong KV", "errors", "no cases"]


class GapsError(OverlayError):
    """The known-gaps file is unreadable or names something unknown."""


class KnownGap(msgspec.Struct, forbid_unknown_fields=True):
    layout: str
    """As the simulator names it: ``name`` or ``name/dcpN``."""
    problem: Problem
    tracked_by: str
    """The issue or patch that tracks it (``issue 20``, a pull request URL)."""
    why: str
    scope: Literal["scheduler", "bytes"] = "scheduler"
    """Which simulator the gap is for: ``simulate`` or ``simulate --bytes``
    (``simulate/bytes/verdict.py`` says how a bytes gap names a
    configuration)."""


class KnownGaps(msgspec.Struct, forbid_unknown_fields=True):
    gap: list[KnownGap] = []


def gap_layout(gap: KnownGap) -> str:
    """The layout a gap is about: a bytes gap may name a configuration
    (``glm read 1->2 LBNHC``), whose first word is its layout."""
    return gap.layout.split()[0] if gap.scope == "bytes" and gap.layout else gap.layout


def load_gaps(path: Path) -> list[KnownGap]:
    """The known gaps; none when the file does not exist."""
    if not path.is_file():
        return []
    gaps = read_toml(path, KnownGaps, "known-gaps file", GapsError).gap
    for g in gaps:
        if not g.tracked_by.strip() or not g.why.strip():
            raise GapsError(f"{path}: {g.layout}: tracked_by and why are required")
    return gaps


def problems(r: LayoutReport) -> list[tuple[Problem, str]]:
    """What is wrong with one layout's run, each with its one-line detail."""
    if r.refused_at_start is not None:
        return []
    if r.cases == 0:
        return [("no cases", "ran no case")]
    out: list[tuple[Problem, str]] = []
    if r.wrong_lengths:
        out.append(
            (
                "wrong KV",
                f"reads wrong KV at {len(r.wrong_lengths)} of {r.lengths_tried} "
                "lengths",
            )
        )
    if r.error_cases:
        out.append(("errors", f"crashes in {r.error_cases} of {r.cases} cases"))
    return out


@dataclass
class Verdict:
    judged: int = 0
    refused: int = 0
    failures: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)
    passing_gaps: list[str] = field(default_factory=list)
    """Known gaps whose layout ran and no longer shows the problem."""

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0

    def line(self) -> str:
        known = f"; {count(len(self.known), 'known gap')}: {', '.join(self.known)}"
        known = known if self.known else ""
        if self.failures:
            return (
                "simulate: FAILED: the overlay falls short in "
                f"{count(len(self.failures), 'layout')}: "
                f"{'; '.join(self.failures)}{known}"
            )
        if not self.judged:
            return "simulate: no overlay layout ran: nothing to judge" + known
        return (
            f"simulate: ok: the overlay reads the right KV in every layout that "
            f"starts ({self.judged - self.refused} run, {self.refused} refused at "
            f"start){known}"
        )


def judge(report: SweepReport, gaps: list[KnownGap]) -> Verdict:
    """The verdict on the overlay rows of ``report``; with no overlay run, a
    sweep that ran no case at all still fails."""
    gaps = [g for g in gaps if g.scope == "scheduler"]
    by_key = {(g.layout, g.problem): g for g in gaps}
    verdict = Verdict()
    rows = [r for r in report.layouts if r.variant == "overlay"]
    if "overlay" not in report.variants:
        if not any(r.cases for r in report.layouts):
            verdict.failures.append("the sweep ran no case")
        return verdict
    if not rows:
        verdict.failures.append("no layout ran")
    for r in rows:
        verdict.judged += 1
        verdict.refused += r.refused_at_start is not None
        found = problems(r)
        for problem, detail in found:
            gap = by_key.get((r.layout, problem))
            if gap is None:
                verdict.failures.append(f"{r.layout} {detail}")
            else:
                verdict.known.append(f"{r.layout} {problem} ({gap.tracked_by})")
        shown = {p for p, _ in found}
        verdict.passing_gaps += [
            f"{g.layout} ({g.problem})"
            for g in gaps
            if g.layout == r.layout and g.problem not in shown
        ]
    if rows and not any(r.cases for r in rows):
        refused = ", ".join(f"{r.layout} by {r.refused_by or '?'}" for r in rows)
        verdict.failures.append(
            f"no case ran: every layout was refused at start ({refused})"
        )
    return verdict
