"""Port a patch's test module to vLLM's layout as one self-contained file.

The overlay's tests live in ``tests/patches/`` and use builders from the
``conftest.py`` beside them (and sibling helper modules). vLLM's tree has
neither, so the port inlines every definition the test module needs, found
by name: functions, classes and constants it references, fixtures it names
as parameters, autouse fixtures, and what those need in turn. Imports are
merged and rewritten; imports of the local modules are dropped (an alias
becomes an assignment). The result starts with vLLM's SPDX header.

What cannot be ported is an error, never guessed around: a local module used
as a module (``import helpers``; ``helpers.x``), a name defined twice by
different local modules, an import of the overlay's own package.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.errors import OverlayError

SPDX_HEADER = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
UPSTREAM_TEST_DIR = "tests/v1/kv_connector/unit"
_FORBIDDEN = ("vllm_overlay", "tests")


# "Patch 0003: ..." opening a test docstring names the overlay, not vLLM.
_PATCH_PREFIX = re.compile(r'^([rRuU]?(?:"""|\'\'\'))Patch \d{4}:\s*(\w)')


def _drop_prefix(m: re.Match[str]) -> str:
    return m.group(1) + m.group(2).upper()


class PortError(OverlayError):
    """A test module cannot be turned into a self-contained upstream test."""


@dataclass
class _Module:
    name: str
    path: Path
    source: str
    tree: ast.Module
    lines: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.lines = self.source.splitlines(keepends=True)

    def segment(self, stmt: ast.stmt) -> str:
        """The statement's source with its decorators and the comment lines
        directly above it."""
        start = min(
            [stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])]
        )
        first = start - 1
        while first > 0 and self.lines[first - 1].lstrip().startswith("#"):
            first -= 1
        assert stmt.end_lineno is not None
        return "".join(self.lines[first : stmt.end_lineno])


def upstream_test_path(test_file: Path) -> str:
    """``tests/patches/test_0001_multi_groups.py`` ->
    ``tests/v1/kv_connector/unit/test_moriio_multi_groups.py``."""
    stem = test_file.stem.removeprefix("test_")
    head, sep, rest = stem.partition("_")
    if sep and head.isdigit():
        stem = rest
    if not stem.startswith("moriio"):
        stem = f"moriio_{stem}"
    return f"{UPSTREAM_TEST_DIR}/test_{stem}.py"


def _parse(path: Path, name: str) -> _Module:
    try:
        source = path.read_text()
    except OSError as e:
        raise PortError(f"{path}: cannot read: {e.strerror}") from None
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise PortError(f"{path}: {e}") from None
    return _Module(name, path, source, tree)


def _bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [stmt.name]
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        targets = [stmt.target]
    names = []
    for t in targets:
        for node in ast.walk(t):
            if isinstance(node, ast.Name):
                names.append(node.id)
    return names


def _referenced(node: ast.AST) -> set[str]:
    """Names a statement uses: loads, parameter names (fixtures), and names
    inside string annotations."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.arg):
            out.add(sub.arg)
            if isinstance(sub.annotation, ast.Constant):
                out |= _names_in_string(sub.annotation.value)
        elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
            if isinstance(sub.returns, ast.Constant):
                out |= _names_in_string(sub.returns.value)
        elif isinstance(sub, ast.AnnAssign) and isinstance(
            sub.annotation, ast.Constant
        ):
            out |= _names_in_string(sub.annotation.value)
    return out


def _names_in_string(value: object) -> set[str]:
    if not isinstance(value, str):
        return set()
    try:
        expr = ast.parse(value, mode="eval")
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}


def _is_type_checking(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.If)
        and isinstance(stmt.test, ast.Name | ast.Attribute)
        and ast.unparse(stmt.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
    )


def _is_autouse_fixture(stmt: ast.stmt) -> bool:
    if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    for dec in stmt.decorator_list:
        if isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.fixture":
            for kw in dec.keywords:
                if kw.arg == "autouse" and ast.unparse(kw.value) == "True":
                    return True
    return False


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


@dataclass
class _Imports:
    """Import aliases: bound name -> one-alias import statement source."""

    runtime: dict[str, str] = field(default_factory=dict)
    type_only: dict[str, str] = field(default_factory=dict)
    future: bool = False

    def add(
        self, stmt: ast.Import | ast.ImportFrom, type_only: bool, where: str
    ) -> None:
        table = self.type_only if type_only else self.runtime
        if isinstance(stmt, ast.ImportFrom):
            if stmt.module == "__future__":
                self.future = True
                return
            module = "." * stmt.level + (stmt.module or "")
            for alias in stmt.names:
                bound = alias.asname or alias.name
                as_ = f" as {alias.asname}" if alias.asname else ""
                self._put(
                    table, bound, f"from {module} import {alias.name}{as_}", where
                )
        else:
            for alias in stmt.names:
                bound = alias.asname or alias.name.split(".")[0]
                as_ = f" as {alias.asname}" if alias.asname else ""
                self._put(table, bound, f"import {alias.name}{as_}", where)

    @staticmethod
    def _put(table: dict[str, str], bound: str, line: str, where: str) -> None:
        if table.get(bound, line) != line:
            raise PortError(
                f"{where}: {bound!r} is imported two ways ({table[bound]!r}, {line!r})"
            )
        table[bound] = line


def _local_module_name(
    stmt: ast.ImportFrom | ast.Import, local: set[str]
) -> str | None:
    """The local module an import names (``conftest``, ``helpers``,
    ``tests.patches.helpers``, ``.helpers``), None for any other."""
    names = (
        [stmt.module or ""]
        if isinstance(stmt, ast.ImportFrom)
        else [a.name for a in stmt.names]
    )
    for name in names:
        last = name.rsplit(".", 1)[-1]
        if last in local and (
            "." not in name
            or name.startswith("tests.")
            or (isinstance(stmt, ast.ImportFrom) and stmt.level > 0)
        ):
            return last
    return None


def port_test(test_file: Path) -> str:
    """The self-contained upstream version of ``test_file`` (not yet
    formatted: run ruff format on it)."""
    local_dir = test_file.parent
    local = {p.stem for p in local_dir.glob("*.py") if p != test_file}
    test = _parse(test_file, test_file.stem)
    modules: dict[str, _Module] = {}
    imports = _Imports()
    aliases: list[str] = []
    # Per module: a name imported from a local module -> (module, name).
    links: dict[str, dict[str, tuple[str, str]]] = {}

    def load(name: str) -> _Module:
        if name not in modules:
            modules[name] = _parse(local_dir / f"{name}.py", name)
            scan_imports(modules[name])
        return modules[name]

    def scan_imports(mod: _Module) -> None:
        table = links.setdefault(mod.name, {})
        for stmt in mod.tree.body:
            group = [stmt]
            type_only = False
            if _is_type_checking(stmt):
                assert isinstance(stmt, ast.If)
                group, type_only = list(stmt.body), True
            for s in group:
                if not isinstance(s, ast.Import | ast.ImportFrom):
                    continue
                where = f"{mod.path.name}:{s.lineno}"
                target = _local_module_name(s, local)
                if target is not None:
                    if isinstance(s, ast.Import):
                        raise PortError(
                            f"{where}: `import {target}` uses a local module as a "
                            f"module; import the names (`from {target} import ...`)"
                        )
                    load(target)
                    for alias in s.names:
                        table[alias.asname or alias.name] = (target, alias.name)
                        if alias.asname and alias.asname != alias.name:
                            aliases.append(f"{alias.asname} = {alias.name}\n")
                    continue
                top = (
                    (s.module or "")
                    if isinstance(s, ast.ImportFrom)
                    else s.names[0].name
                ).split(".")[0]
                if top in _FORBIDDEN and not (
                    isinstance(s, ast.ImportFrom) and s.level
                ):
                    raise PortError(
                        f"{where}: imports {top!r}, which is not in vLLM's tree"
                    )
                imports.add(s, type_only, where)

    modules[test.name] = test
    scan_imports(test)
    if "conftest" in local:
        load("conftest")

    # Each module's top-level definitions, by name.
    defs: dict[str, dict[str, ast.stmt]] = {
        m.name: {n: st for st in m.tree.body for n in _bound_names(st)}
        for m in modules.values()
    }

    def resolve(module: str, name: str) -> tuple[str, ast.stmt] | None:
        """Where ``name`` used in ``module`` is defined: the module itself,
        a local module it imports the name from, else conftest (fixtures)."""
        for _ in range(len(modules) + 1):
            if name in defs[module]:
                return module, defs[module][name]
            if name not in links.get(module, {}):
                break
            module, name = links[module][name]
        if "conftest" in defs and name in defs["conftest"]:
            return "conftest", defs["conftest"][name]
        return None

    body = [
        s
        for s in test.tree.body
        if not (s is test.tree.body[0] and _is_docstring(s))
        and not isinstance(s, ast.Import | ast.ImportFrom)
        and not _is_type_checking(s)
    ]
    own = {n for s in body for n in _bound_names(s)}
    needed: dict[int, tuple[str, ast.stmt]] = {}
    todo = [(test.name, n) for n in sorted({n for s in body for n in _referenced(s)})]
    for mod in modules.values():
        for stmt in mod.tree.body:
            if mod is not test and _is_autouse_fixture(stmt):
                needed[id(stmt)] = (mod.name, stmt)
                todo.extend((mod.name, n) for n in _referenced(stmt))
    seen: set[tuple[str, str]] = set()
    while todo:
        module, name = todo.pop()
        if (module, name) in seen or (module == test.name and name in own):
            continue
        seen.add((module, name))
        found = resolve(module, name)
        if found is None or found[0] == test.name:
            continue
        where, stmt = found
        if id(stmt) not in needed:
            needed[id(stmt)] = (where, stmt)
            todo.extend((where, n) for n in _referenced(stmt))

    by_name: dict[str, str] = {}
    for where, stmt in needed.values():
        for name in _bound_names(stmt):
            if by_name.setdefault(name, where) != where:
                raise PortError(
                    f"{name!r} is needed from both {by_name[name]}.py and "
                    f"{where}.py; rename one of them"
                )
    for where, stmt in [*needed.values(), *((test.name, s) for s in body)]:
        for node in ast.walk(stmt):
            value = getattr(node, "value", None)
            if isinstance(node, ast.Constant) and isinstance(value, str):
                hit = [m for m in local if f"{m}.py" in value]
                if hit:
                    raise PortError(
                        f"{where}.py runs or reads {hit[0]}.py as a file, which "
                        "vLLM's tree does not have"
                    )

    inlined: list[str] = []
    for mod in modules.values():
        chosen = [s for s in mod.tree.body if id(s) in needed]
        if chosen and mod is not test:
            inlined.append("# Builders the tests below share.\n")
            inlined.extend(mod.segment(s) + "\n\n" for s in chosen)
    test_body = [test.segment(s) + "\n\n" for s in body]

    used: set[str] = {name for _, name in seen}
    for stmt in body:
        used |= _referenced(stmt)
    for _, stmt in needed.values():
        used |= _referenced(stmt)
    runtime = sorted({v for k, v in imports.runtime.items() if k in used})
    type_only = sorted(
        {
            v
            for k, v in imports.type_only.items()
            if k in used and k not in imports.runtime
        }
    )
    if type_only:
        flag = imports.runtime.get("TYPE_CHECKING", "from typing import TYPE_CHECKING")
        runtime = sorted({*runtime, flag})
    out = [SPDX_HEADER]
    first = test.tree.body[0] if test.tree.body else None
    if first is not None and _is_docstring(first):
        out.append(_PATCH_PREFIX.sub(_drop_prefix, test.segment(first), count=1))
        out.append("\n")
    if imports.future:
        out.append("from __future__ import annotations\n\n")
    out.extend(line + "\n" for line in runtime)
    if type_only:
        out.append("\nif TYPE_CHECKING:\n")
        out.extend(f"    {line}\n" for line in type_only)
    out.append("\n\n")
    out.extend(inlined)
    out.extend(aliases)
    out.append("\n\n")
    out.extend(test_body)
    return "".join(out).rstrip("\n") + "\n"
