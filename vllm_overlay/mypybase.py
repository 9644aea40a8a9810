"""Which mypy errors on the overlaid vLLM files are the series' own.

`nox -s lint` runs mypy with vLLM's settings on the overlaid files and on
the same files of the pinned base. An error the base has as well (the same
file, error code and message; line numbers differ, as the series moves the
base's lines) is the base's; every other one is the series'. Stdlib only:
the noxfile imports it.
"""

from __future__ import annotations

from typing import NamedTuple


class MypyError(NamedTuple):
    path: str
    code: str  # "" when mypy gives none
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (f" [{self.code}]" if self.code else "")


def parse_errors(report: str) -> list[MypyError]:
    """The ``error:`` lines of a mypy report, without their line numbers."""
    out = []
    for line in report.splitlines():
        path, sep, rest = line.partition(":")
        if not sep or ": error: " not in rest:
            continue
        message = rest.split(": error: ", 1)[1].rstrip()
        code = ""
        if message.endswith("]") and "  [" in message:
            message, _, code = message.rpartition("  [")
            code = code[:-1]
        out.append(MypyError(path, code, message.strip()))
    return out


def errors_of_ours(base: list[MypyError], overlaid: list[MypyError]) -> list[MypyError]:
    """The overlaid errors the base does not have, each base error matching
    one overlaid error at most (a series that repeats a base error has one
    more of it)."""
    left = list(base)
    ours = []
    for error in overlaid:
        if error in left:
            left.remove(error)
        else:
            ours.append(error)
    return ours
