"""README.md says what the code checks: the header fields and the series."""

from __future__ import annotations

import ast

from tests.repo import REPO
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


def _section(heading: str) -> str:
    return README.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_command_line_section_lists_every_command() -> None:
    from vllm_overlay.cli import build_parser

    parser = build_parser()
    commands = next(
        a.choices
        for a in parser._actions  # argparse keeps its subcommands there
        if isinstance(a.choices, dict)
    )
    section = _section("The command line")
    missing = [c for c in commands if f"vllm-overlay {c}" not in section]
    assert not missing, f"README's command line leaves out {missing}"


def _noxfile() -> ast.Module:
    return ast.parse((REPO / "noxfile.py").read_text())


def test_the_readme_says_what_a_plain_nox_runs() -> None:
    defaults = next(
        ast.literal_eval(node.value)
        for node in _noxfile().body
        if isinstance(node, ast.Assign)
        and ast.unparse(node.targets[0]) == "nox.options.sessions"
    )
    said = ", ".join(f"`{s}`" for s in defaults).replace(", ", " and ")
    assert f"A plain `nox` runs the default sessions, {said}" in README


def test_the_sessions_table_is_every_session() -> None:
    sessions = []
    for node in _noxfile().body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and ast.unparse(deco.func) == "nox.session":
                name = next(
                    (
                        ast.literal_eval(k.value)
                        for k in deco.keywords
                        if k.arg == "name"
                    ),
                    node.name,
                )
                sessions.append(name)
            elif ast.unparse(deco) == "nox.session":
                sessions.append(node.name)
    rows = [row[0].strip("`") for row in _table("Sessions")]
    assert sorted(rows) == sorted(sessions)
