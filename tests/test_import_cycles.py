"""No import cycle in ``vllm_overlay`` (tests/import_graph.py reads the
graph, function-local imports included)."""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import find_cycle, import_graph


def test_no_import_cycle_in_the_package(repo: Path) -> None:
    cycle = find_cycle(import_graph(repo))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_function_local_import_closing_a_circle_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import x\n    return x\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.a", "pkg.b", "pkg.a"]


def test_relative_and_type_checking_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("from ..d import y\nfrom . import e\n")
    (package / "sub" / "e.py").write_text("")
    (package / "d.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.sub.c import z\n"
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.c"] == {"pkg.d", "pkg.sub.e"}
    assert graph["pkg.d"] == set()
    assert find_cycle(graph) is None
