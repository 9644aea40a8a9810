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


class RebaseReport(msgspec.Struct, forbid_unknown_fields=True):
    from_version: str
    to_version: str
    to_source: str
    series_id: str
    workdir: str
    rows: list[RebaseRow]
    written: bool = False

    @property
    def ok(self) -> bool:
        return all(r.result in ("clean", "offset", "upstream") for r in self.rows)


def format_table(report: RebaseReport) -> str:
    rows = [("patch", "result", "detail")] + [
        (r.patch, r.result, r.detail or "-") for r in report.rows
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [
        f"rebase: {report.from_version} -> {report.to_version} ({report.to_source})"
    ]
    lines += [f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def encode_report(report: RebaseReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"
