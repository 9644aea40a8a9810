"""Which mypy errors on the overlaid vLLM files are the series' own.

`nox -s lint` runs mypy with vLLM's settings on the overlaid files and on
the same files of the pinned base. An error the base has as well (the same
file, error code and message; line numbers differ, as the series moves the
base's lines) is the base's; every other one is the series'. The base's
errors depend only on the wheel, mypy and the settings: they are kept per
`base_key` (vllm_overlay/mypybasecache.py, ci/mypy-base-errors/). Stdlib
only: the noxfile imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
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


def settings_sha256(
    config: str, python_version: str, files: Sequence[str], environment: Sequence[str]
) -> str:
    """What the base's errors depend on besides the wheel and mypy: vLLM's
    settings, the Python version, the files checked and the environment
    mypy reads the dependencies from (its requirement pins)."""
    parts = [config, python_version, "\n".join(sorted(files)), *environment]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def base_key(wheel_sha256: str, mypy_version: str, settings: str) -> str:
    """The name of a cached base report: the wheel, mypy and the settings."""
    return f"{wheel_sha256[:16]}-mypy-{mypy_version}-{settings[:16]}"


def format_errors(errors: Sequence[MypyError]) -> str:
    """``errors`` as mypy's report lines (line 0), as `parse_errors` reads them."""
    return "".join(
        f"{e.path}:0: error: {e.message}" + (f"  [{e.code}]" if e.code else "") + "\n"
        for e in errors
    )
