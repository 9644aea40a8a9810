"""The graph of every ``vllm_overlay`` module's imports of our own modules,
read from the AST, module level and function-local both (a function-local
import hides a cycle from Python, not from the reader)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "vllm_overlay"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = name.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    return ".".join([*parts[:keep], *([node.module] if node.module else [])])


def imports_of(path: Path, root: Path, modules: frozenset[str]) -> set[str]:
    """Our modules a file imports anywhere in its body (``from a import b``
    names ``a.b`` when that is a module, else ``a``); imports under ``if
    TYPE_CHECKING`` are left out, they never run."""
    name = module_name(path, root)
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(inner) for part in node.body for inner in ast.walk(part))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, name, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else base)
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    paths = sorted((root / package).rglob("*.py"))
    modules = frozenset(module_name(path, root) for path in paths)
    graph: dict[str, set[str]] = {}
    for path in paths:
        # a package's __init__ runs before its modules: importing a.b imports
        # a, so an edge into a.b is an edge into a too; we only follow the
        # edges the files name, and __init__ files of ours import nothing.
        graph[module_name(path, root)] = imports_of(path, root, modules)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its modules in order, first repeated last),
    or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None
