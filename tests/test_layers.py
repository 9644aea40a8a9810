"""The package's layers: a module imports only modules of its own layer or
below (no arrow up), and no module-level import circle.

The order is the one docs/architecture.md draws, lowest first. Every
area's ``cli.py`` (and the root ``cli.py``) sits on top: it may import any
area. The import graph is read statically (module-level imports, as
`vllm_overlay.gate.imports` reads a test file's).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_overlay.gate.imports import imported_names, local_file

# Lowest first; a module's layer is its longest matching prefix here.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "vllm_overlay",  # the package's __init__: the version only
        "vllm_overlay.errors",
        "vllm_overlay.text",
        "vllm_overlay.tomlfile",
        "vllm_overlay.safefile",
        "vllm_overlay.noxlog",
        "vllm_overlay.noxterm",
        "vllm_overlay.mypybase",
        "vllm_overlay.mypybasecache",
        "vllm_overlay.cpuplatform",
    ),
    ("vllm_overlay.series",),
    ("vllm_overlay.checkout",),
    ("vllm_overlay.command",),
    ("vllm_overlay.transaction",),
    ("vllm_overlay.tree",),
    ("vllm_overlay.gate",),
    ("vllm_overlay.simulate",),
    ("vllm_overlay.image", "vllm_overlay.e2e"),
    ("vllm_overlay.upstream",),
)
TOP = len(LAYERS)


def layer(module: str) -> int:
    """The layer of ``module``; every ``cli`` module is on top."""
    if module == "vllm_overlay.cli" or module.endswith(".cli"):
        return TOP
    best, rank = "", -1
    for r, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            hit = module == prefix or module.startswith(prefix + ".")
            if hit and len(prefix) > len(best):
                best, rank = prefix, r
    if rank < 0:
        raise AssertionError(f"{module}: in no layer of tests/test_layers.py")
    return rank


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "vllm_overlay") -> dict[str, set[str]]:
    """Each module of ``package`` under ``root`` and the package modules it
    imports at module level."""
    graph: dict[str, set[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        found = set()
        for name in imported_names(path.resolve(), root.resolve()):
            target = local_file(name, path, root)
            if target is not None and target.is_relative_to(root / package):
                found.add(module_name(target, root))
        graph[module_name(path, root)] = found - {module_name(path, root)}
    return graph


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer(d) > layer(m)
    )


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_a_layer_above_it(repo: Path) -> None:
    assert arrows_up(import_graph(repo)) == []


def test_no_import_circle_outside_simulate(repo: Path) -> None:
    # simulate/ is re-layered on its own (issue 39); its circles are its own.
    found = circles(import_graph(repo))
    assert [c for c in found if not all(".simulate" in m for m in c)] == []


def test_every_module_has_a_layer(repo: Path) -> None:
    for module in import_graph(repo):
        layer(module)


def test_an_arrow_up_is_found(tmp_path: Path) -> None:
    """The check can fail: a series module importing the tree is caught,
    and so is a circle."""
    pkg = tmp_path / "vllm_overlay"
    (pkg / "series").mkdir(parents=True)
    (pkg / "tree").mkdir()
    for d in (pkg, pkg / "series", pkg / "tree"):
        (d / "__init__.py").write_text("")
    (pkg / "series" / "pin.py").write_text("from vllm_overlay.tree import status\n")
    (pkg / "tree" / "status.py").write_text("from vllm_overlay.series import pin\n")
    graph = import_graph(tmp_path)
    # `from vllm_overlay.tree import status` imports the package and the module
    assert arrows_up(graph) == [
        "vllm_overlay.series.pin -> vllm_overlay.tree",
        "vllm_overlay.series.pin -> vllm_overlay.tree.status",
    ]
    assert circles(graph) == [["vllm_overlay.series.pin", "vllm_overlay.tree.status"]]


@pytest.mark.parametrize(
    ("module", "rank"),
    [("vllm_overlay.series.pin", 1), ("vllm_overlay.tree.cli", TOP)],
)
def test_layer_of(module: str, rank: int) -> None:
    assert layer(module) == rank
