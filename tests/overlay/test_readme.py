"""README.md says what the code checks: the header fields and the series."""

from __future__ import annotations

from tests.overlay.workspace import REPO
from vllm_overlay.series.patch_series import (
    DEP3_FIELDS,
    PROJECT_FIELDS,
    REQUIRED_FIELDS,
    load_series,
)

README = (REPO / "README.md").read_text()


def _table(heading: str) -> list[list[str]]:
    """The body rows of the first Markdown table under ``## heading``."""
    section = README.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("|")
    ]
    assert len(rows) > 2, f"no table under '## {heading}'"
    return rows[2:]


def test_header_fields_are_the_checked_fields() -> None:
    rows = _table("Patch headers")
    fields = [row[0].strip("`") for row in rows]
    assert sorted(fields) == sorted((*DEP3_FIELDS, *PROJECT_FIELDS))
    required = [row[0].strip("`") for row in rows if row[1].startswith("yes")]
    assert sorted(required) == sorted(REQUIRED_FIELDS)


def test_series_table_is_the_series() -> None:
    series = load_series(REPO)
    rows = _table("The series")
    assert [f"{row[0]}-{row[1].strip('`')}.patch" for row in rows] == series.names
    for row, patch in zip(rows, series.patches, strict=True):
        h = patch.header
        change, forwarded = row[2], row[3]
        assert change.startswith("upstream" if h.is_upstream else "ours"), patch.name
        if h.forwarded_url:
            assert h.forwarded_url in forwarded, patch.name
        else:
            assert forwarded == h.forwarded, patch.name
