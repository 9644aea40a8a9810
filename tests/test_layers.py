"""The package's layers: a module imports only modules of its own layer or
below (no arrow up); tests/test_import_cycles.py finds circles.

The order is the one docs/architecture.md draws, lowest first. Every
area's ``cli.py`` (and the root ``cli.py``) sits on top: it may import any
area. The import graph is read statically, function-local imports
included (tests/import_graph.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import find_cycle, import_graph

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
        "vllm_overlay.warm",
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


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer(d) > layer(m)
    )


def test_no_module_imports_a_layer_above_it(repo: Path) -> None:
    assert arrows_up(import_graph(repo)) == []


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
    assert arrows_up(graph) == ["vllm_overlay.series.pin -> vllm_overlay.tree.status"]
    assert find_cycle(graph) == [
        "vllm_overlay.series.pin",
        "vllm_overlay.tree.status",
        "vllm_overlay.series.pin",
    ]


@pytest.mark.parametrize(
    ("module", "rank"),
    [("vllm_overlay.series.pin", 1), ("vllm_overlay.tree.cli", TOP)],
)
def test_layer_of(module: str, rank: int) -> None:
    assert layer(module) == rank
