"""Plain-text tables of both simulators' reports."""

from __future__ import annotations

from collections.abc import Sequence

TABLE_WIDTH = 120


def clip(text: str, width: int) -> str:
    """``text`` on one line in at most ``width`` characters; when longer, cut
    after a whole word and marked with "..." (the full text is in the JSON)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    room = max(width - 3, 1)
    head = text[: room + 1]
    cut = head.rfind(" ")
    head = head[:cut] if cut > 0 else text[:room]
    return head.rstrip(" ,;:") + "..."


def ratio(num: int, den: int) -> str:
    if den == 0:
        return "-" if num == 0 else "inf"
    return f"{num / den:.2f}"


def table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns; a rule under the first row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = (cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
