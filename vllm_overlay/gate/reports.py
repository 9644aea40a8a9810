"""Reports that cross from one nox session to another (JSON on disk).

`nox -s unit-base` writes a `RevertRedReport` to `.nox-reports/unit-base.json`:
every test id of the suite with its outcome on the pinned base and with the
whole series (``rows``), and per patch every test its header names (`Tests`:
revert-red; `Guards`: pass on both sides) with its outcome on the stack below
the patch and on the stack with it (``stack``). `vllm-overlay export` reads it
to fill a PR's test results; it never invents one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

import msgspec

from vllm_overlay.checkout import REPORT_DIR, UNIT_BASE_REPORT
from vllm_overlay.errors import OverlayError

# "not run": a named test missing from a stack level's run.
TestOutcome = Literal["passed", "failed", "error", "skipped", "not run"]
Role = Literal["test", "guard"]


class ReportError(OverlayError):
    """A report is missing, unreadable, or for another series."""


_T = TypeVar("_T")


def load_struct(
    path: Path,
    kind: type[_T],
    what: str,
    a_file: str,
    error: type[OverlayError] = ReportError,
) -> _T:
    """``path`` decoded as ``kind``; ``error``, one line naming ``what`` it
    should hold (``a_file``: "an outcomes file"), when it cannot be read or
    is not one."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read the {what}: {e.strerror}") from None
    try:
        return msgspec.json.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise error(f"{path}: not {a_file} ({e})") from None


class RevertRedRow(msgspec.Struct, forbid_unknown_fields=True):
    test_id: str
    patch: str  # the patch whose Tests header names test_id, "" for none
    base: TestOutcome
    overlay: TestOutcome

    @property
    def revert_red(self) -> bool:
        """Fails (or errors) on the base and passes with the overlay."""
        return self.base in ("failed", "error") and self.overlay == "passed"


class StackRow(msgspec.Struct, forbid_unknown_fields=True):
    """A test a patch names, on the stack below the patch (patches 1..K-1 on
    the base) and with it (1..K)."""

    test_id: str
    patch: str
    role: Role  # "test": fails below, passes with; "guard": passes on both
    below: TestOutcome
    with_: TestOutcome = msgspec.field(name="with")

    @property
    def holds(self) -> bool:
        if self.role == "guard":
            return self.below == "passed" and self.with_ == "passed"
        return self.below in ("failed", "error") and self.with_ == "passed"


class RevertRedReport(msgspec.Struct, forbid_unknown_fields=True):
    vllm_version: str
    series_id: str
    generated_at: str  # ISO 8601, UTC
    rows: list[RevertRedRow]
    stack: list[StackRow] = []

    def rows_for(self, patch: str) -> list[RevertRedRow]:
        return [r for r in self.rows if r.patch == patch]

    def stack_for(self, patch: str) -> list[StackRow]:
        return [r for r in self.stack if r.patch == patch]

    def rows_named(self, test_id: str) -> list[RevertRedRow]:
        """The rows a ``Tests:`` header entry names: the id itself, or every
        parametrization of it."""
        return [r for r in self.rows if names(test_id, r.test_id)]


def names(named: str, test_id: str) -> bool:
    """Whether a header entry names ``test_id``: the id itself, or a test
    function naming every parametrization of it."""
    return test_id == named or test_id.startswith(named + "[")


def unit_base_report_path(root: Path) -> Path:
    return root / REPORT_DIR / UNIT_BASE_REPORT


def encode_report(report: RevertRedReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"


def load_revert_red(path: Path) -> RevertRedReport:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ReportError(
            f"{path}: no unit-base report; run `nox -s unit-base` first"
        ) from None
    except OSError as e:
        raise ReportError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return msgspec.json.decode(data, type=RevertRedReport)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ReportError(
            f"{path}: not a unit-base report ({e}); re-run `nox -s unit-base`"
        ) from None
