"""The result of a rebase: one row per patch, as a table and as JSON."""

from __future__ import annotations

from collections import Counter
from typing import Literal

import msgspec

from vllm_overlay.errors import OverlayError

Result = Literal[
    "clean", "offset", "upstream", "partly upstream", "conflict", "blocked"
]
# What the new base holds of one hunk of a patch that did not move as it
# was (``anotherform`` weighs them): the hunk landed; upstream changed its
# lines in its own form with something of ours there; it applies on its own
# (still to carry); none of these.
HunkState = Literal["", "landed", "changed upstream", "still to carry", "conflicting"]
# The results that let the series move: the rest need a person (and so
# does a row with ``hand`` set).
MOVES: tuple[Result, ...] = ("clean", "offset", "upstream", "partly upstream")
# Evidence lines shown per landed hunk in the table (the report has all).
SHOWN_EVIDENCE = 3


class RebaseError(OverlayError):
    """The new base cannot be obtained or the result cannot be written."""


class HunkNote(msgspec.Struct, forbid_unknown_fields=True):
    file: str
    hunk: int  # 1-based, in the patch's order for that file
    header: str
    offset: int = 0
    problem: str = ""
    # Non-empty when the new base already holds the hunk: why (one line),
    # and the new base's lines that show it (``LINE: text``).
    landed: str = ""
    evidence: list[str] = []
    state: HunkState = ""


class RebaseRow(msgspec.Struct, forbid_unknown_fields=True):
    patch: str
    result: Result
    detail: str
    hunks: list[HunkNote] = []
    # Files written to the work directory (conflicts): merged results.
    merged: list[str] = []
    # Each conflict as ``path:line`` of its ``.merged`` file (the line of its
    # ``<<<<<<<`` marker), as compilers and grep print places.
    conflicts: list[str] = []
    # A patch that landed upstream in another form (``partly upstream``)
    # without a hand-refreshed remainder: what to do, in one line. The
    # series cannot move while any row has one.
    hand: str = ""
    # The upstream change the header names (Forwarded, Origin, Bug).
    landed_as: str = ""
    # The hand-refreshed version used in the patch's place (--refreshed).
    refreshed: str = ""
    # Patches below, landed in another form, left out of the new base's
    # chain in the files this one touches: it was assessed without them.
    set_aside: list[str] = []

    @property
    def label(self) -> str:
        """The result as the table shows it: ``clean (0001 set aside)``."""
        if not self.set_aside:
            return self.result
        numbers = ", ".join(name.split("-", 1)[0] for name in self.set_aside)
        return f"{self.result} ({numbers} set aside)"


class RebaseReport(msgspec.Struct, forbid_unknown_fields=True):
    from_version: str
    to_version: str
    to_source: str
    series_id: str
    workdir: str
    rows: list[RebaseRow]
    written: bool = False
    # The new base is an older vLLM release than the pinned one.
    downgrade: bool = False
    # The new base is the pinned base with this very series applied (an
    # overlaid install): nothing to do, and no rows.
    carries_series: bool = False
    # The git ref the series was read from (--series-ref), "" for the
    # checkout's own patches/.
    series_ref: str = ""

    @property
    def ok(self) -> bool:
        return all(r.result in MOVES and not r.hand for r in self.rows)

    @property
    def by_hand(self) -> list[RebaseRow]:
        return [r for r in self.rows if r.hand]


def format_table(report: RebaseReport) -> str:
    """One row per patch; under it, one line per landed hunk (and its first
    evidence lines), and under a conflict one line per conflict (the
    ``.merged`` file and line), per hunk that does not apply, and per merge
    to review."""
    rows = [("patch", "result", "detail")] + [
        (r.patch, r.label, r.detail or "-") for r in report.rows
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [
        f"rebase: {report.from_version} -> {report.to_version} ({report.to_source})"
    ]
    if report.series_ref:
        lines.append(f"rebase: the series of {report.series_ref}")
    if report.downgrade:
        lines.append(
            f"rebase: warning: {report.to_version} is older than the pinned "
            f"{report.from_version}: this moves the series back (a downgrade)"
        )
    lines.append(f"  {rows[0][0]:<{w0}}  {rows[0][1]:<{w1}}  {rows[0][2]}")
    for r, (a, b, c) in zip(report.rows, rows[1:], strict=True):
        lines.append(f"  {a:<{w0}}  {b:<{w1}}  {c}")
        lines += _landed_lines(r)
        if r.hand:
            lines += _state_lines(r)
        elif r.result != "conflict":
            continue
        else:
            lines += [
                f"      {h.file.rsplit('/', 1)[-1]}: hunk #{h.hunk} does not apply: "
                f"{h.problem} ({h.header})"
                for h in r.hunks
                if h.problem
            ]
        lines += [f"      {place}: conflict" for place in r.conflicts]
        marked = {place.rsplit(":", 1)[0] for place in r.conflicts}
        lines += [f"      {m}: review" for m in r.merged if m not in marked]
        if r.hand:
            lines.append(f"      by hand: {r.hand}")
    return "\n".join(lines)


def _state_lines(row: RebaseRow) -> list[str]:
    """A patch landed in another form: each hunk that did not land, with
    its state (changed upstream, still to carry, conflicting) and why."""
    out = []
    for h in row.hunks:
        if h.state in ("", "landed"):
            continue
        why = h.problem.removeprefix("context not found; ")
        why = why.removeprefix(f"{h.state}: ") or "applies to the new base"
        if h.state == "conflicting" and why.startswith("changed upstream: "):
            why = "nothing of ours there: " + why
        name = h.file.rsplit("/", 1)[-1]
        out.append(f"      {name}: hunk #{h.hunk} {h.state}: {why} ({h.header})")
    return out


def _landed_lines(row: RebaseRow) -> list[str]:
    out = []
    for h in row.hunks:
        if not h.landed:
            continue
        name = h.file.rsplit("/", 1)[-1]
        out.append(f"      {name}: hunk #{h.hunk} landed: {h.landed}")
        out += [f"          {e}" for e in h.evidence[:SHOWN_EVIDENCE]]
        if len(h.evidence) > SHOWN_EVIDENCE:
            more = len(h.evidence) - SHOWN_EVIDENCE
            out.append(f"          (+{more} more line(s) in the report)")
    return out


def result_counts(report: RebaseReport) -> str:
    """How many patches got each result, in the table's order of results:
    ``1 upstream, 13 offset``."""
    counts = Counter(r.result for r in report.rows)
    order: tuple[Result, ...] = (*MOVES, "conflict", "blocked")
    return ", ".join(f"{counts[k]} {k}" for k in order if counts[k]) or "no patch"


def encode_report(report: RebaseReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"
