"""Words for counts in what the commands print: ``1 test``, ``2 tests``."""

from __future__ import annotations


def count(n: int, singular: str, plural: str | None = None) -> str:
    """``n`` and the noun in the number ``n`` needs (``plural`` for a noun
    that does not take an ``s``)."""
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def verb(n: int, singular: str, plural: str) -> str:
    """The verb form for ``n`` subjects: ``verb(1, "fails", "fail")``."""
    return singular if n == 1 else plural
