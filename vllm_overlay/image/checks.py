"""One check from inside the image and how an exception reads in it."""

from __future__ import annotations

import traceback

import msgspec


class Check(msgspec.Struct):
    name: str
    ok: bool
    detail: str


def last_line(e: BaseException) -> str:
    lines = traceback.format_exception_only(type(e), e)
    return " ".join(lines[-1].split())
