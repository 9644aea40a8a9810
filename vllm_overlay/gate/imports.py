"""What a test module imports when pytest collects it: a static analysis.

The module-level imports (not those inside functions, nor under ``if
TYPE_CHECKING``) of a test file, of its conftests, and of every module of
the checkout they import in turn (``tests.*``, ``vllm_overlay.*``, or a file
beside the importer). `vllm_overlay.gate.shards` keeps the test files that
import vLLM's MoRIIO package at collection in processes of their own: in a
process where that package is loaded, every test counts as touching it
(`vllm_overlay.gate.touch`), so the other files run apart.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level(body: Iterable[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody):
                yield from _module_level(part)
            for handler in node.handlers:
                yield from _module_level(handler.body)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from _module_level(node.body)


def _package(path: Path, root: Path) -> str:
    """The dotted package of a file under ``root`` (``tests.patches``)."""
    return ".".join(path.parent.relative_to(root).parts)


@cache
def imported_names(path: Path, root: Path) -> tuple[str, ...]:
    """The modules a file imports at module level, absolute and dotted
    (``from a import b`` names both ``a`` and ``a.b``). Each file is parsed
    once per process: every test file's closure shares the checkout's
    modules."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return ()
    names: list[str] = []
    for node in _module_level(tree.body):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            parts = _package(path, root).split(".")
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(p for p in [*parts, base] if p)
        names.append(base)
        names.extend(f"{base}.{alias.name}" for alias in node.names)
    return tuple(names)


def local_file(name: str, importer: Path, root: Path) -> Path | None:
    """The checkout's file for module ``name``: under ``root``, or (a bare
    name) beside the importer, as pytest's rootdir-relative imports find it."""
    return _local_file(name, importer.parent, root)


@cache
def _local_file(name: str, directory: Path, root: Path) -> Path | None:
    parts = name.split(".")
    for base in (root, directory):
        candidate = base.joinpath(*parts)
        for path in (candidate.with_suffix(".py"), candidate / "__init__.py"):
            if path.is_file():
                return path
    return None


@cache
def _closure(path: Path, root: Path) -> frozenset[str]:
    seen: set[Path] = set()
    external: set[str] = set()
    stack = [path]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in imported_names(current, root):
            found = local_file(name, current, root)
            if found is None:
                external.add(name)
            elif found not in seen:
                stack.append(found)
    return frozenset(external)


def conftests(test_file: Path, root: Path) -> list[Path]:
    """The conftest.py files pytest loads for a test file, root first."""
    found: list[Path] = []
    directory = test_file.parent
    while directory.is_relative_to(root):
        if (directory / "conftest.py").is_file():
            found.append(directory / "conftest.py")
        if directory == root:
            break
        directory = directory.parent
    return found[::-1]


def collection_imports(test_file: Path, root: Path) -> frozenset[str]:
    """The modules outside the checkout that collecting ``test_file`` imports
    (as named in the checkout's sources, not what they import in turn)."""
    names: set[str] = set()
    for path in (*conftests(test_file, root), test_file):
        names |= _closure(path.resolve(), root.resolve())
    return frozenset(names)


def imports_package(test_file: Path, root: Path, package: str) -> bool:
    """Whether collecting ``test_file`` imports ``package`` or a module in it."""
    return any(
        n == package or n.startswith(package + ".")
        for n in collection_imports(test_file, root)
    )


def third_party(names: Iterable[str], root: Path) -> list[str]:
    """Of ``names`` (as `collection_imports` gives them), those outside the
    standard library, vLLM and the checkout under ``root``: what a server
    that forks test runs imports once for all of them (hypothesis takes a
    second a run)."""
    kept: dict[str, None] = {}
    for name in sorted(names):
        top = name.split(".", 1)[0]
        if top in sys.stdlib_module_names or top == "vllm":
            continue
        if _local_file(top, root, root) is not None or _namespace(root / top):
            continue
        kept[name] = None
    return list(kept)


def _namespace(directory: Path) -> bool:
    """A directory of the checkout that imports as a namespace package."""
    return directory.is_dir() and any(directory.glob("*.py"))
