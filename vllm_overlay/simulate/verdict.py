"""The simulator's verdict on the overlay: one line and an exit status.

A layout that starts must read the right KV with the overlay, at every prompt
length and hit tried, without a crash, and run at least one case. A layout
refused at start (MoRIIO or vLLM failing closed) is no failure, unless every
layout of the run was: then no case ran at all. A layout that
falls short is a failure unless ``docs/known-gaps.toml`` lists it, for that
problem, with the issue or patch that tracks it. The base variant is not
judged: it is what the series fixes. A pair whose decoder runs the base
build (``overlay->base``, a rolling upgrade's prefill half) reads wrong KV
only where the base pair of the same run reads right: a case the base pair
gets wrong as well is the base decoder's own (only the decoder can be
fixed), counted and shown, not a failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.simulate.builds import BuildPair
from vllm_overlay.simulate.faults import FaultReport
from vllm_overlay.simulate.report import LayoutReport, SweepReport
from vllm_overlay.simulate.writes import WRITE, row_key
from vllm_overlay.text import count
from vllm_overlay.tomlfile import read_toml

GAPS_FILE = Path("docs") / "known-gaps.toml"
SIMULATE_REPORT = "simulate.json"
JUDGED_PAIRS = ("overlay", "base->overlay", "overlay->base")
EVERY_PAIR = "all"
Problem = Literal["wrong KV", "errors", "escapes", "no cases"]


class GapsError(OverlayError):
    """The known-gaps file is unreadable or names something unknown."""


class KnownGap(msgspec.Struct, forbid_unknown_fields=True):
    layout: str
    """As the simulator names it: ``name`` or ``name/dcpN``; a scheduler gap
    of WRITE adds the mode: ``name write`` (``writes.row_key``)."""
    problem: Problem
    tracked_by: str
    """The issue or patch that tracks it (``issue 20``, a pull request URL)."""
    why: str
    scope: Literal["scheduler", "bytes", "faults"] = "scheduler"
    """Which simulator the gap is for: ``simulate``, ``simulate-bytes``
    (``simulate/bytes/verdict.py`` says how a bytes gap names a
    configuration) or ``simulate --faults`` (a layout, or ``layout fault``)."""
    pair: str = "overlay"
    """The pair of builds it is about: ``overlay``, ``base->overlay`` or
    ``overlay->base`` (``builds.py``), or ``all`` for a gap both builds
    share (each of the three); the base alone is never judged."""


class KnownGaps(msgspec.Struct, forbid_unknown_fields=True):
    gap: list[KnownGap] = []


def gap_layout(gap: KnownGap) -> str:
    """The layout a gap is about: a bytes gap may name a configuration
    (``glm read 1->2 LBNHC``), a scheduler gap a WRITE row (``glm
    write``), whose first word is its layout."""
    if gap.layout:
        return gap.layout.split()[0]
    return gap.layout


def load_gaps(path: Path) -> list[KnownGap]:
    """The known gaps; none when the file does not exist."""
    if not path.is_file():
        return []
    gaps = read_toml(path, KnownGaps, "known-gaps file", GapsError).gap
    for g in gaps:
        if not g.tracked_by.strip() or not g.why.strip():
            raise GapsError(f"{path}: {g.layout}: tracked_by and why are required")
        if g.pair not in (*JUDGED_PAIRS, EVERY_PAIR):
            raise GapsError(
                f"{path}: {g.layout}: pair {g.pair!r}: one of "
                f"{', '.join(JUDGED_PAIRS)} or {EVERY_PAIR}"
            )
    return gaps


def gap_index(gaps: list[KnownGap]) -> dict[tuple[str, Problem, str], KnownGap]:
    """The gaps by (layout, problem, pair), a gap of every pair under each."""
    return {
        (g.layout, g.problem, pair): g
        for g in gaps
        for pair in (JUDGED_PAIRS if g.pair == EVERY_PAIR else (g.pair,))
    }


WrongCases = frozenset[tuple[str, int]]
"""(hit percentage, prompt length) of each case with wrong KV."""


def wrong_cases(by_hit: dict[str, list[int]]) -> WrongCases:
    return frozenset((hit, n) for hit, lengths in by_hit.items() for n in lengths)


def base_decoder(variant: str) -> bool:
    """Whether the pair's decoder runs the base build while its prefiller
    does not: its wrong cases are judged against the base pair's."""
    pair = BuildPair.parse(variant)
    return pair.mixed and pair.decode == "base"


def beyond_base(wrong: WrongCases, base: WrongCases | None) -> tuple[WrongCases, int]:
    """The wrong cases of a base-decoder pair that the base pair reads right
    (all of them when the run has no base pair to compare with), and how
    many the base pair gets wrong too."""
    if base is None:
        return wrong, 0
    return wrong - base, len(wrong & base)


def problems(
    r: LayoutReport, base_wrong: WrongCases | None = None
) -> list[tuple[Problem, str]]:
    """What is wrong with one layout's run, each with its one-line detail;
    ``base_wrong``: the base pair's wrong cases of the layout, for a pair
    with a base decoder."""
    if r.refused_at_start is not None:
        return []
    if r.cases == 0:
        return [("no cases", "ran no case")]
    out: list[tuple[Problem, str]] = []
    if base_decoder(r.variant):
        own, shared = beyond_base(wrong_cases(r.wrong_lengths_by_hit), base_wrong)
        if own:
            where = "" if base_wrong is None else " where the base pair reads right"
            detail = f"reads wrong KV in {count(len(own), 'case')}{where}"
            out.append(("wrong KV", detail))
    elif r.wrong_lengths:
        out.append(
            (
                "wrong KV",
                f"reads wrong KV at {len(r.wrong_lengths)} of {r.lengths_tried} "
                "lengths",
            )
        )
    crashes = r.error_cases - r.escape_cases
    if crashes:
        out.append(("errors", f"crashes in {crashes} of {r.cases} cases"))
    out.extend(escape_problems(r.escape_cases, r.cases))
    return out


def judged(variant: str) -> bool:
    """Whether a pair is judged: every pair with an overlaid leg (the base
    alone is what the series fixes)."""
    return variant != "base"


def shown(layout: str, variant: str) -> str:
    """A row's name in the verdict: its layout, and its pair unless the
    overlay."""
    return layout if variant == "overlay" else f"{layout} ({variant})"


@dataclass
class Verdict:
    judged: int = 0
    refused: int = 0
    failures: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)
    passing_gaps: list[str] = field(default_factory=list)
    """Known gaps whose layout ran and no longer shows the problem."""
    base_decoder_wrong: int = 0
    """Wrong cases of base-decoder pairs that the base pair has too."""
    base_decoder_faults: int = 0
    """Fault rows of base-decoder pairs failing as the base pair's row of
    the same layout and fault does (the fault hits vLLM's own decoder)."""
    wrote: bool = False
    """Some judged row ran WRITE: the KV is moved, not only read."""

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0

    def line(self) -> str:
        known = f"; {count(len(self.known), 'known gap')}: {', '.join(self.known)}"
        known = known if self.known else ""
        if self.base_decoder_wrong:
            known += (
                f"; {count(self.base_decoder_wrong, 'wrong case')} of base "
                "decoders where the base pair is wrong too"
            )
        if self.base_decoder_faults:
            known += (
                f"; {count(self.base_decoder_faults, 'fault row')} of base "
                "decoders failing as the base pair does"
            )
        if self.failures:
            return (
                "simulate: FAILED: the overlay falls short in "
                f"{count(len(self.failures), 'layout')}: "
                f"{'; '.join(self.failures)}{known}"
            )
        if not self.judged:
            return "simulate: no overlay layout ran: nothing to judge" + known
        moves = "moves" if self.wrote else "reads"
        return (
            f"simulate: ok: the overlay {moves} the right KV in every layout that "
            f"starts ({self.judged - self.refused} run, {self.refused} refused at "
            f"start){known}"
        )


def judge(report: SweepReport, gaps: list[KnownGap]) -> Verdict:
    """The verdict on every pair of ``report`` with an overlaid leg; with
    none run, a sweep that ran no case at all still fails. ``--faults``
    rows are judged by ``judge_faults``."""
    if report.faults:
        return judge_faults(report, gaps)
    gaps = [g for g in gaps if g.scope == "scheduler"]
    by_key = gap_index(gaps)
    verdict = Verdict()
    rows = [r for r in report.layouts if judged(r.variant)]
    if not any(judged(v) for v in report.variants):
        if not any(r.cases for r in report.layouts):
            verdict.failures.append("the sweep ran no case")
        return verdict
    if not rows:
        verdict.failures.append("no layout ran")
    base_wrong = {
        row_key(r.layout, r.mode): wrong_cases(r.wrong_lengths_by_hit)
        for r in report.layouts
        if r.variant == "base" and r.refused_at_start is None
    }
    for r in rows:
        verdict.judged += 1
        verdict.refused += r.refused_at_start is not None
        verdict.wrote |= r.mode == WRITE
        key = row_key(r.layout, r.mode)
        found = problems(r, base_wrong.get(key))
        if base_decoder(r.variant) and r.refused_at_start is None:
            _, shared = beyond_base(
                wrong_cases(r.wrong_lengths_by_hit), base_wrong.get(key)
            )
            verdict.base_decoder_wrong += shared
        name = shown(key, r.variant)
        for problem, detail in found:
            gap = by_key.get((key, problem, r.variant))
            if gap is None:
                verdict.failures.append(f"{name} {detail}")
            else:
                verdict.known.append(f"{name} {problem} ({gap.tracked_by})")
        seen = {p for p, _ in found}
        verdict.passing_gaps += [
            f"{shown(g.layout, g.pair)} ({g.problem})"
            for g in gaps
            if g.layout == key
            and g.pair in (r.variant, EVERY_PAIR)
            and g.problem not in seen
        ]
    if rows and not any(r.cases for r in rows):
        refused = ", ".join(
            f"{row_key(r.layout, r.mode)} by {r.refused_by or '?'}" for r in rows
        )
        verdict.failures.append(
            f"no case ran: every layout was refused at start ({refused})"
        )
    return verdict


def fault_problems(r: FaultReport) -> list[tuple[Problem, str]]:
    """What is wrong with one fault row: an exception out of the scheduler,
    another crash, or a request left with wrong KV (the intact one, or the
    refused one not served right)."""
    if r.refused_at_start is not None or not r.cases:
        return []
    out: list[tuple[Problem, str]] = []
    if r.escapes:
        out.append(
            (
                "escapes",
                f"an exception escapes the scheduler in {r.escapes} of {r.cases} cases",
            )
        )
    if r.crashes:
        out.append(("errors", f"crashes in {r.crashes} of {r.cases} cases"))
    unserved = r.cases - r.escapes - r.crashes - r.other_right
    if unserved or r.refused_wrong:
        out.append(
            (
                "wrong KV",
                f"the intact request is not served right in {unserved} cases, the "
                f"refused one holds wrong KV in {r.refused_wrong}",
            )
        )
    return out


def judge_faults(report: SweepReport, gaps: list[KnownGap]) -> Verdict:
    """The verdict on the fault rows of every pair with an overlaid leg. A
    gap of ``scope = "faults"`` names a layout (every fault) or ``layout
    fault``."""
    by_key = gap_index([g for g in gaps if g.scope == "faults"])
    # A fault injected into vLLM's own MoRIIO decoder (overlay->base) is that
    # decoder's to handle: a problem its base pair shows too is not judged.
    base_problems = {
        (r.layout, r.fault): {p for p, _ in fault_problems(r)}
        for r in report.faults
        if r.variant == "base"
    }
    verdict = Verdict()
    for r in report.faults:
        if not judged(r.variant):
            continue
        verdict.judged += 1
        verdict.refused += r.refused_at_start is not None
        name = shown(f"{r.layout} {r.fault}", r.variant)
        found = fault_problems(r)
        if base_decoder(r.variant):
            shared = base_problems.get((r.layout, r.fault), set())
            verdict.base_decoder_faults += any(p in shared for p, _ in found)
            found = [(p, d) for p, d in found if p not in shared]
        for problem, detail in found:
            gap = by_key.get((f"{r.layout} {r.fault}", problem, r.variant))
            gap = gap or by_key.get((r.layout, problem, r.variant))
            if gap is None:
                verdict.failures.append(f"{name} {detail}")
            else:
                verdict.known.append(f"{name} {problem} ({gap.tracked_by})")
    return verdict


def escape_problems(escape_cases: int, cases: int) -> list[tuple[Problem, str]]:
    """The escapes of a configuration's cases, as a problem (none if none)."""
    if not escape_cases:
        return []
    text = f"an exception escapes the scheduler in {escape_cases} of {cases} cases"
    return [("escapes", text)]
