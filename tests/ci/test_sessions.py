"""`nox -l` lists every session by the first line of its docstring: that
line is a whole sentence, never one cut off mid-way."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.repo import REPO


def _sessions() -> dict[str, str]:
    """Each nox session's function name and docstring, read from the noxfile
    (nox itself is not installed where the tests run)."""
    tree = ast.parse((REPO / "noxfile.py").read_text())
    out: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            target = deco.func if isinstance(deco, ast.Call) else deco
            if ast.unparse(target) == "nox.session":
                out[node.name] = ast.get_docstring(node) or ""
    return out


def test_each_session_is_listed_by_a_whole_sentence() -> None:
    sessions = _sessions()
    assert {"lint", "unit", "unit_base", "simulate"} <= set(sessions)
    for name, doc in sessions.items():
        lines = doc.splitlines()
        assert lines, f"session {name} has no docstring: `nox -l` lists it bare"
        first = lines[0]
        assert first.endswith("."), f"{name}: {first!r} is not a whole sentence"
        assert len(lines) == 1 or not lines[1].strip(), (
            f"{name}: the sentence `nox -l` shows goes on past {first!r}"
        )


def test_the_noxfile_imports_with_the_standard_library_alone() -> None:
    """nox's own environment holds nox and nothing else: the noxfile, and
    what it imports of ci/ and the package, import with the standard
    library alone (`python -S`: no site-packages; nox a stand-in)."""
    code = (
        "import sys; from unittest import mock; sys.path.insert(0, '.'); "
        "sys.modules['nox'] = mock.MagicMock(); import noxfile; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('msgspec', 'tomli_w', 'vllm')))"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
