"""Port a patch's test module to vLLM's layout as one self-contained file.

The overlay's tests live in ``tests/patches/`` and use the fixtures of the
``conftest.py`` beside them and sibling helper modules (``builders.py``, a
patch's harness). vLLM's tree has neither, so the port inlines every
definition the test module needs, found by name: functions, classes and
constants it references, fixtures it names as parameters (or by string, to
``request.getfixturevalue`` and ``pytest.mark.usefixtures``), autouse
fixtures, and what those need in turn. Imports are kept per module: an
import is kept only when a statement the port takes from that module uses
it (a local module the port draws nothing from adds no import), and then
merged; imports of the local modules are dropped (an alias becomes an
assignment). The result starts with vLLM's SPDX header.

What cannot be ported is an error, never guessed around: a local module used
as a module (``import helpers``; ``helpers.x``), a name defined twice by
different local modules, a name one module imports and another defines (or
two modules import two ways), an import of the overlay's own package.
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
# Local modules that stand in for a module of vLLM's test tree: a port imports
# the names from vLLM's module (relative to UPSTREAM_TEST_DIR, as vLLM's
# test_moriio_connector.py does) instead of inlining them.
VLLM_HELPER_MODULES = {"vllm_unit_utils": "utils"}
# Words that name this repository, not vLLM, in a ported file.
_OUR_WORDS = ("vllm_overlay", "vllm-overlay", "tests/patches", "tests.patches")
# A patch of this series named by its number ("patch 0008", "0013:").
_PATCH_NUMBER = re.compile(r"(?<![\w.])0\d{3}(?![\w.])")


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
    """Names a statement reads from the module: loads and names inside string
    annotations. A function's own names (its parameters and what its body
    binds) are not references: a local variable called like a builder does
    not pull the builder in."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        args = node.args
        outer: list[ast.AST] = [*args.defaults, *(d for d in args.kw_defaults if d)]
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        every += [a for a in (args.vararg, args.kwarg) if a is not None]
        out = {n for a in every for n in _annotation_names(a.annotation)}
        if isinstance(node, ast.Lambda):
            body: list[ast.AST] = [node.body]
        else:
            outer += node.decorator_list
            out |= _annotation_names(node.returns)
            body = list(node.body)
        own = {a.arg for a in every} | {n for b in body for n in _bound_in(b)}
        for sub in outer:
            out |= _referenced(sub)
        out |= {n for b in body for n in _referenced(b)} - own
        return out
    out = set()
    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
        out.add(node.id)
    elif isinstance(node, ast.AnnAssign):
        out |= _annotation_names(node.annotation)
    for child in ast.iter_child_nodes(node):
        out |= _referenced(child)
    return out


def _annotation_names(annotation: ast.expr | None) -> set[str]:
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant):
        return _names_in_string(annotation.value)
    return _referenced(annotation)


def _bound_in(node: ast.AST) -> set[str]:
    """The names a function body binds (stores, nested definitions, imports),
    its nested functions' bodies aside."""
    out: set[str] = set()
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        out.add(node.id)
    elif isinstance(node, ast.Import | ast.ImportFrom):
        out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    elif isinstance(node, ast.ExceptHandler) and node.name:
        out.add(node.name)
    elif isinstance(node, ast.Lambda):
        return out
    for child in ast.iter_child_nodes(node):
        out |= _bound_in(child)
    return out


def _parameters(node: ast.AST) -> set[str]:
    """The parameter names of the functions in a statement: pytest fixtures
    when a conftest defines them."""
    return {sub.arg for sub in ast.walk(node) if isinstance(sub, ast.arg)}


# Calls naming fixtures by string: ``request.getfixturevalue(name)``,
# ``pytest.mark.usefixtures("a", "b")``.
_BY_NAME = ("getfixturevalue", "usefixtures")


def _fixture_strings(node: ast.AST) -> set[str]:
    """The strings of a statement that asks pytest for fixtures by name (the
    name may be computed: every string the statement holds counts)."""
    asks = any(
        isinstance(sub, ast.Attribute) and sub.attr in _BY_NAME
        for sub in ast.walk(node)
    )
    if not asks:
        return set()
    return {
        sub.value
        for sub in ast.walk(node)
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str)
    }


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


def _is_fixture(stmt: object) -> bool:
    return isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and any(
        ast.unparse(d.func if isinstance(d, ast.Call) else d) == "pytest.fixture"
        for d in stmt.decorator_list
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
    """One module's import aliases: bound name -> one-alias import statement
    source."""

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

    def line(self, bound: str) -> tuple[str, bool] | None:
        """The import binding ``bound``, and whether it is type-only."""
        if bound in self.runtime:
            return self.runtime[bound], False
        if bound in self.type_only:
            return self.type_only[bound], True
        return None

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
    porter = _Porter(test_file)
    body = porter.test_body()
    needed, imported = porter.needed(body)
    porter.check(needed, body)
    text = porter.render(body, needed, imported)
    found = our_names(text, porter.local | {porter.test.name})
    if found:
        raise PortError(
            "the port names this repository, not vLLM: "
            + "; ".join(f"line {n}: {word!r}" for n, word in found[:5])
            + (f" (and {len(found) - 5} more)" if len(found) > 5 else "")
            + "; say it in vLLM's terms in the test module and the helpers"
        )
    return text


def our_names(text: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, word) for each name of this repository in ``text``: the local
    test modules, the overlay's package and test folder, a patch number."""
    words = [*_OUR_WORDS, *sorted(m for m in modules if m != "conftest")]
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for word in words:
            # The substring test first: most lines hold none of the words.
            if word in line and re.search(
                rf"(?<![\w/.]){re.escape(word)}(?![\w])", line
            ):
                found.append((n, word))
        found.extend((n, m.group()) for m in _PATCH_NUMBER.finditer(line))
    return found


# A statement the port inlines, and the local module defining it.
_Needed = dict[int, tuple[str, ast.stmt]]
# An import the port keeps: (the module importing it, the bound name).
_Imported = set[tuple[str, str]]


class _Porter:
    """The test module, the local modules it draws on, and their imports."""

    def __init__(self, test_file: Path):
        self.dir = test_file.parent
        # A test directory without a conftest of its own (tests/patches/core/)
        # draws on its parent's conftest and helpers, as pytest lets it.
        dirs = [self.dir]
        if (
            not (self.dir / "conftest.py").is_file()
            and (self.dir.parent / "conftest.py").is_file()
        ):
            dirs.insert(0, self.dir.parent)
        self.paths = {p.stem: p for d in dirs for p in d.glob("*.py") if p != test_file}
        self.local = set(self.paths)
        self.test = _parse(test_file, test_file.stem)
        self.modules: dict[str, _Module] = {self.test.name: self.test}
        # Per module: its imports of names from outside the local modules.
        self.imports: dict[str, _Imports] = {}
        self.aliases: list[str] = []
        # Per module: a name imported from a local module -> (module, name).
        self.links: dict[str, dict[str, tuple[str, str]]] = {}
        self._scan_imports(self.test)
        if "conftest" in self.local:
            self._load("conftest")
        # Each module's top-level definitions, by name.
        self.defs: dict[str, dict[str, ast.stmt]] = {
            m.name: {n: st for st in m.tree.body for n in _bound_names(st)}
            for m in self.modules.values()
        }

    def _load(self, name: str) -> _Module:
        if name not in self.modules:
            self.modules[name] = _parse(self.paths[name], name)
            self._scan_imports(self.modules[name])
        return self.modules[name]

    def _scan_imports(self, mod: _Module) -> None:
        table = self.links.setdefault(mod.name, {})
        for stmt in mod.tree.body:
            group = [stmt]
            type_only = False
            if _is_type_checking(stmt):
                assert isinstance(stmt, ast.If)
                group, type_only = list(stmt.body), True
            for s in group:
                if isinstance(s, ast.Import | ast.ImportFrom):
                    self._scan_import(mod, s, table, type_only)

    def _scan_import(
        self,
        mod: _Module,
        s: ast.Import | ast.ImportFrom,
        table: dict[str, tuple[str, str]],
        type_only: bool,
    ) -> None:
        where = f"{mod.path.name}:{s.lineno}"
        target = _local_module_name(s, self.local)
        if target in VLLM_HELPER_MODULES and isinstance(s, ast.ImportFrom):
            vllm = ast.ImportFrom(
                module=VLLM_HELPER_MODULES[target], names=s.names, level=1
            )
            self.imports.setdefault(mod.name, _Imports()).add(vllm, type_only, where)
            return
        if target is not None:
            if isinstance(s, ast.Import):
                raise PortError(
                    f"{where}: `import {target}` uses a local module as a "
                    f"module; import the names (`from {target} import ...`)"
                )
            self._load(target)
            for alias in s.names:
                table[alias.asname or alias.name] = (target, alias.name)
                if alias.asname and alias.asname != alias.name:
                    self.aliases.append(f"{alias.asname} = {alias.name}\n")
            return
        imported = s.module if isinstance(s, ast.ImportFrom) else s.names[0].name
        module = imported or ""
        top = module.split(".")[0]
        if top in _FORBIDDEN and not (isinstance(s, ast.ImportFrom) and s.level):
            raise PortError(f"{where}: imports {top!r}, which is not in vLLM's tree")
        self.imports.setdefault(mod.name, _Imports()).add(s, type_only, where)

    def _imports(self, module: str) -> _Imports:
        return self.imports.get(module) or _Imports()

    def _resolve(
        self, module: str, name: str
    ) -> tuple[str, ast.stmt] | tuple[str, str] | None:
        """What ``name`` used in ``module`` is: a definition (module,
        statement) in the module itself or in a local module it imports the
        name from; an outside import (module, bound name) of that module;
        else a conftest definition (a fixture); None for anything else."""
        for _ in range(len(self.modules) + 1):
            if name in self.defs[module]:
                return module, self.defs[module][name]
            if name not in self.links.get(module, {}):
                break
            module, name = self.links[module][name]
        if self._imports(module).line(name) is not None:
            return module, name
        if "conftest" in self.defs and name in self.defs["conftest"]:
            return "conftest", self.defs["conftest"][name]
        return None

    def test_body(self) -> list[ast.stmt]:
        """The test module's statements, without its docstring and imports."""
        tree = self.test.tree
        return [
            s
            for s in tree.body
            if not (s is tree.body[0] and _is_docstring(s))
            and not isinstance(s, ast.Import | ast.ImportFrom)
            and not _is_type_checking(s)
        ]

    def needed(self, body: list[ast.stmt]) -> tuple[_Needed, _Imported]:
        """Every local definition the test body needs, transitively, and
        every outside import those and the body use, by the module whose
        import it is."""
        test = self.test.name
        own = {n for s in body for n in _bound_names(s)}
        needed: _Needed = {}
        imported: _Imported = set()
        todo = [(test, n) for n in sorted({n for s in body for n in _referenced(s)})]
        todo.extend(self._fixtures(body, test))
        for mod in self.modules.values():
            for stmt in mod.tree.body:
                if mod is not self.test and _is_autouse_fixture(stmt):
                    needed[id(stmt)] = (mod.name, stmt)
                    todo.extend((mod.name, n) for n in _referenced(stmt))
                    todo.extend(self._fixtures([stmt], mod.name))
        seen: set[tuple[str, str]] = set()
        while todo:
            module, name = todo.pop()
            if (module, name) in seen or (module == test and name in own):
                continue
            seen.add((module, name))
            found = self._resolve(module, name)
            if found is None:
                continue
            where, what = found
            if isinstance(what, str):
                imported.add((where, what))
            elif where != test and id(what) not in needed:
                needed[id(what)] = (where, what)
                todo.extend((where, n) for n in _referenced(what))
                todo.extend(self._fixtures([what], where))
        return needed, imported

    def _fixtures(self, stmts: list[ast.stmt], module: str) -> list[tuple[str, str]]:
        """The fixtures the statements of ``module`` name (as parameters, or
        as strings where a statement asks pytest for fixtures by name): the
        conftest's, and those ``module`` imports from another local module."""
        fixtures = self.defs.get("conftest", {})
        names = {n for s in stmts for n in _parameters(s) | _fixture_strings(s)}
        out = [("conftest", n) for n in sorted(names) if n in fixtures]
        for n in sorted(names - set(fixtures)):
            if n in self.links.get(module, {}):
                found = self._resolve(module, n)
                if found is not None and _is_fixture(found[1]):
                    out.append((module, n))
        return out

    def check(self, needed: _Needed, body: list[ast.stmt]) -> None:
        """No name comes from two local modules; nothing reads a local
        module as a file."""
        by_name: dict[str, str] = {}
        for where, stmt in needed.values():
            for name in _bound_names(stmt):
                if by_name.setdefault(name, where) != where:
                    raise PortError(
                        f"{name!r} is needed from both {by_name[name]}.py and "
                        f"{where}.py; rename one of them"
                    )
        test = self.test.name
        for where, stmt in [*needed.values(), *((test, s) for s in body)]:
            for node in ast.walk(stmt):
                value = getattr(node, "value", None)
                if isinstance(node, ast.Constant) and isinstance(value, str):
                    hit = [m for m in self.local if f"{m}.py" in value]
                    if hit:
                        raise PortError(
                            f"{where}.py runs or reads {hit[0]}.py as a file, which "
                            "vLLM's tree does not have"
                        )

    def render(self, body: list[ast.stmt], needed: _Needed, imported: _Imported) -> str:
        inlined: list[str] = []
        for mod in self.modules.values():
            chosen = [s for s in mod.tree.body if id(s) in needed]
            if chosen and mod is not self.test:
                inlined.append("# Builders the tests below share.\n")
                inlined.extend(mod.segment(s) + "\n\n" for s in chosen)
        defined = {
            name: f"{where}.py"
            for where, stmt in [
                *needed.values(),
                *((self.test.name, s) for s in body),
            ]
            for name in _bound_names(stmt)
        }
        out = [SPDX_HEADER]
        first = self.test.tree.body[0] if self.test.tree.body else None
        if first is not None and _is_docstring(first):
            out.append(
                _PATCH_PREFIX.sub(_drop_prefix, self.test.segment(first), count=1)
            )
            out.append("\n")
        out.extend(self._import_lines(imported, defined))
        out.append("\n\n")
        out.extend(inlined)
        out.extend(self.aliases)
        out.append("\n\n")
        out.extend(self.test.segment(s) + "\n\n" for s in body)
        return "".join(out).rstrip("\n") + "\n"

    def _import_lines(self, imported: _Imported, defined: dict[str, str]) -> list[str]:
        """The kept imports, merged: one file has one namespace, so a name
        bound two ways (two imports, or an import and an inlined
        definition) is refused, naming both."""
        lines: dict[str, tuple[str, bool, str]] = {}
        for module, bound in sorted(imported):
            found = self._imports(module).line(bound)
            assert found is not None
            line, type_only = found
            if bound in defined:
                raise PortError(
                    f"{bound!r} is both imported by {module}.py ({line!r}) and "
                    f"defined in {defined[bound]}; use one of them"
                )
            have = lines.get(bound)
            if have is not None and have[0] != line:
                raise PortError(
                    f"{bound!r} is imported two ways: {have[0]!r} in {have[2]}.py, "
                    f"{line!r} in {module}.py"
                )
            if have is None or not type_only:
                lines[bound] = (line, type_only, module)
        runtime = sorted({line for line, t, _ in lines.values() if not t})
        type_only_lines = sorted({line for line, t, _ in lines.values() if t})
        if type_only_lines:
            flag = lines.get("TYPE_CHECKING", ("from typing import TYPE_CHECKING",))[0]
            runtime = sorted({*runtime, flag})
        future = any(i.future for i in self.imports.values())
        out = ["from __future__ import annotations\n\n"] if future else []
        out.extend(line + "\n" for line in runtime)
        if type_only_lines:
            out.append("\nif TYPE_CHECKING:\n")
            out.extend(f"    {line}\n" for line in type_only_lines)
        return out
