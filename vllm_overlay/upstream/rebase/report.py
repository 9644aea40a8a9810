"""The result of a rebase: one row per patch, as a table and as JSON."""

from __future__ import annotations

from typing import Literal

import msgspec

from vllm_overlay.errors import OverlayError

Result = Literal["clean", "offset", "upstream", "conflict", "blocked"]


class RebaseError(OverlayError):
    """The new base cannot be obtained or the result cannot be written."""


class HunkNote(msgspec.Struct, forbid_unknown_fields=True):
    file: str
    hunk: int  # 1-based, in the patch's order for that file
    header: str
    offset: int = 0
    problem: str = ""


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

    @property
    def ok(self) -> bool:
        return all(r.result in ("clean", "offset", "upstream") for r in self.rows)


def format_table(report: RebaseReport) -> str:
    """One row per patch; under a conflict, one line per conflict (the
    ``.merged`` file and line), per hunk that does not apply, and per merge
    to review."""
    rows = [("patch", "result", "detail")] + [
        (r.patch, r.result, r.detail or "-") for r in report.rows
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [
        f"rebase: {report.from_version} -> {report.to_version} ({report.to_source})"
    ]
    if report.downgrade:
        lines.append(
            f"rebase: warning: {report.to_version} is older than the pinned "
            f"{report.from_version}: this moves the series back (a downgrade)"
        )
    lines.append(f"  {rows[0][0]:<{w0}}  {rows[0][1]:<{w1}}  {rows[0][2]}")
    for r, (a, b, c) in zip(report.rows, rows[1:], strict=True):
        lines.append(f"  {a:<{w0}}  {b:<{w1}}  {c}")
        if r.result != "conflict":
            continue
        lines += [f"      {place}: conflict" for place in r.conflicts]
        lines += [
            f"      {h.file.rsplit('/', 1)[-1]}: hunk #{h.hunk} does not apply: "
            f"{h.header}"
            for h in r.hunks
            if h.problem
        ]
        marked = {place.rsplit(":", 1)[0] for place in r.conflicts}
        lines += [f"      {m}: review" for m in r.merged if m not in marked]
    return "\n".join(lines)


def encode_report(report: RebaseReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"
