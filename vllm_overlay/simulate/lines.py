"""What both simulators' worker processes report besides results
(``Progress``), and the case counting their reports share."""

from __future__ import annotations

from typing import Protocol

import msgspec


class Progress(msgspec.Struct, tag="progress"):
    variant: str
    layout: str
    done: int
    total: int


class CaseCounts(Protocol):
    cases: int
    error_cases: int
    first_errors: list[str]


def count_case(report: CaseCounts, error: str | None) -> bool:
    """Count one case; True when it is an error (the first three distinct
    errors are kept)."""
    report.cases += 1
    if error is None:
        return False
    report.error_cases += 1
    if len(report.first_errors) < 3 and error not in report.first_errors:
        report.first_errors.append(error)
    return True
