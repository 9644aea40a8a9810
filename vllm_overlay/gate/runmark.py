"""Marks that note when code of vLLM's MoRIIO package runs, or a value of it
is looked up, at near-zero cost.

Standard library only: `vllm_overlay.gate.touch` installs it in the pytest
process, and a copy of this file rides along with `vllm_overlay.gate.childhook`
into every child Python. `install` puts a finder first on ``sys.meta_path``
that compiles the package's modules from their source (opened as before, so
the first import is still a read) with one statement at the entry of every
function and method, after every statement that resumes a generator or
coroutine, and at the start of what a resumed one runs on a throw (an
``except`` or ``finally`` around a ``yield``, the body of ``async for`` and
``async with``)::

    if __vllm_overlay_mark__.armed: __vllm_overlay_mark__.ran()

placed on the line of the statement it precedes, so tracebacks, ``inspect``
and coverage read the module as written. The package's modules are also of
a `ModuleType` subclass that notes, while a listener is armed (a new scope:
test, fixture, collector, process), every attribute lookup made on them
(``from ... import NAME``, ``module.NAME``, an import of a loaded module); the
first note disarms the listener, so a scope costs one note, and code that
runs unobserved costs one attribute load and test per call. A module keeps
that class: swapping a module's ``__class__`` at each scope while threads a
test left behind run the package's code is not safe in CPython 3.11 (a
segmentation fault in the swap). The compiled code is cached by source,
path, Python and this file's text in ``cache`` (optional).

Not marked: code generated at run time (a dataclass's ``__init__``), lambdas.
A test reaches those only through a value it looked up or got from the
package's marked code, or through a fixture (whose own marks count for it).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import importlib.util
import marshal
import os
import sys
from collections.abc import Callable, Sequence
from types import CodeType, ModuleType
from typing import Any

MARK = "__vllm_overlay_mark__"
RAN, USED = "ran", "used"  # the events a listener is given
# What tools walking sys.modules look up (inspect, warnings, isinstance,
# importlib): not the package's values.
METADATA = frozenset(
    (
        "__name__",
        "__file__",
        "__loader__",
        "__package__",
        "__spec__",
        "__path__",
        "__cached__",
        "__doc__",
        "__class__",
    )
)
# A listener: given the event and what ran or was looked up; returns whether
# it stays armed (False: its scope is noted, nothing more to learn).
Note = Callable[[str, str], bool]


class Marks:
    """The object every marked function tests; `arm` a listener for a new
    scope, `ran` and `used` tell the armed ones."""

    __slots__ = ("armed", "notes", "live", "package")

    def __init__(self, package: str) -> None:
        self.armed = False
        self.package = package
        self.notes: list[Note] = []
        self.live: list[int] = []  # per listener: 0 disarmed, else its scope's count

    def listen(self, note: Note) -> Callable[[], None]:
        """Add a listener, armed; returns the function that arms it again."""
        index = len(self.notes)
        self.notes.append(note)
        self.live.append(1)

        def arm() -> None:
            self.live[index] = self.live[index] % (1 << 30) + 1
            self.armed = True

        self.armed = True
        return arm

    def ran(self) -> None:
        code = sys._getframe(1).f_code
        self._hit(RAN, f"{code.co_filename}:{code.co_qualname}")

    def used(self, module: str, name: str) -> None:
        self._hit(USED, f"{module}.{name}")

    def _hit(self, event: str, what: str) -> None:
        for index, note in enumerate(self.notes):
            scope = self.live[index]
            # Disarmed only if no new scope was armed while noting.
            if scope and not note(event, what) and self.live[index] == scope:
                self.live[index] = 0
        if not any(self.live):
            self.armed = False

    def add(self, module: ModuleType) -> None:
        if type(module) is ModuleType:
            module.__class__ = WatchedModule


class WatchedModule(ModuleType):
    """A module of the package: its attribute lookups are noted while a
    listener is armed (its own code reads its globals directly, unseen)."""

    def __getattribute__(self, name: str) -> Any:
        marks = MARKS[0]
        if marks is not None and marks.armed and name not in METADATA:
            marks.used(ModuleType.__getattribute__(self, "__name__"), name)
        return ModuleType.__getattribute__(self, name)


# The process's marks (one finder per process, whichever copy installed it).
MARKS: list[Marks | None] = [None]


def _at(stmt: ast.stmt) -> ast.stmt:
    """The mark, on ``stmt``'s first line."""
    mark = ast.parse(f"if {MARK}.armed: {MARK}.ran()").body[0]
    for node in ast.walk(mark):
        if isinstance(node, ast.stmt | ast.expr):
            node.lineno = node.end_lineno = stmt.lineno
            node.col_offset = node.end_col_offset = stmt.col_offset
    return mark


SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
RESUMES = (ast.Yield, ast.YieldFrom, ast.Await)


def _resumes(node: ast.AST) -> bool:
    """Whether ``node`` suspends its frame (outside nested scopes)."""
    if isinstance(node, RESUMES):
        return True
    return not isinstance(node, SCOPES) and any(
        _resumes(child) for child in ast.iter_child_nodes(node)
    )


def _blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists a compound statement holds."""
    found: list[list[ast.stmt]] = []
    for _, value in ast.iter_fields(stmt):
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            found.append(value)
        elif isinstance(value, list):
            for item in value:  # except handlers, match cases
                body = getattr(item, "body", None)
                if isinstance(item, ast.excepthandler | ast.match_case) and body:
                    found.append(body)
    return found


def _mark_block(stmts: list[ast.stmt]) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for stmt in stmts:
        out.append(stmt)
        if isinstance(stmt, SCOPES):
            continue
        blocks = _blocks(stmt)
        if not blocks:
            if _resumes(stmt):
                out.append(_at(stmt))
            continue
        for block in blocks:
            block[:] = _mark_block(block)
        starts: list[list[ast.stmt]] = []
        if isinstance(stmt, ast.AsyncFor | ast.AsyncWith):
            starts.append(stmt.body)
        if isinstance(stmt, ast.Try | ast.TryStar) and any(map(_resumes, stmt.body)):
            starts.extend(h.body for h in stmt.handlers)
            starts.append(stmt.finalbody)
        for block in starts:
            if block:
                block.insert(0, _at(block[0]))
    return out


class _Marker(ast.NodeTransformer):
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return self._function(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AST:
        return self._function(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        self.generic_visit(node)
        body = _mark_block(node.body)
        first = body[0]
        doc = (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        )
        at = 1 if doc else 0
        body.insert(at, _at(body[min(at, len(body) - 1)]))
        node.body = body
        return node


def mark_source(source: bytes, path: str) -> CodeType:
    """``source`` compiled with the marks."""
    tree = _Marker().visit(ast.parse(source, path))
    code: CodeType = compile(tree, path, "exec", dont_inherit=True)
    return code


def _salt() -> bytes:
    try:
        with open(__file__, "rb") as f:
            own = f.read()
    except OSError:
        own = b""
    return importlib.util.MAGIC_NUMBER + hashlib.sha256(own).digest()


class MarkedLoader(importlib.machinery.SourceFileLoader):
    """Loads a module of the package from its source, marked; never reads or
    writes its ``__pycache__``."""

    cache = ""
    salt = b""

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        source = self.get_data(path)
        if not self.cache:
            return mark_source(source, path)
        key = hashlib.sha256(self.salt + path.encode() + b"\0" + source).hexdigest()
        cached = os.path.join(self.cache, key)
        try:
            with open(cached, "rb") as f:
                code = marshal.loads(f.read())
            if isinstance(code, CodeType):
                return code
        except (OSError, EOFError, ValueError, TypeError):
            pass
        code = mark_source(source, path)
        try:
            os.makedirs(self.cache, exist_ok=True)
            partial = f"{cached}.{os.getpid()}.tmp"
            with open(partial, "wb") as f:
                f.write(marshal.dumps(code))
            os.replace(partial, cached)
        except OSError:
            pass
        return code

    def exec_module(self, module: ModuleType) -> None:
        marks = MARKS[0]
        module.__dict__[MARK] = marks
        super().exec_module(module)
        if marks is not None:
            marks.add(module)


class MarkingFinder:
    """First on ``sys.meta_path``: the package's modules, as the other
    finders find them, loaded by `MarkedLoader` when they are source files."""

    def __init__(self, marks: Marks) -> None:
        self.marks = marks

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        package = self.marks.package
        if fullname != package and not fullname.startswith(package + "."):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if getattr(finder, "marks", None) is not None or find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is None:
                continue
            if type(spec.loader) is importlib.machinery.SourceFileLoader and (
                spec.origin is not None
            ):
                spec.loader = MarkedLoader(fullname, spec.origin)
            return spec
        return None


def install(package: str, note: Note, cache: str = "") -> Callable[[], None]:
    """Mark ``package``'s modules imported from now on (another copy of this
    module installed first: share its marks) and tell ``note``; returns the
    function that arms it for a new scope."""
    for finder in sys.meta_path:
        shared: Any = getattr(finder, "marks", None)
        if isinstance(getattr(shared, "package", None), str):
            arm: Callable[[], None] = shared.listen(note)
            return arm
    marks = Marks(package)
    MARKS[0] = marks
    MarkedLoader.cache, MarkedLoader.salt = cache, _salt()
    sys.meta_path.insert(0, MarkingFinder(marks))
    return marks.listen(note)


def unmarked(package: str) -> list[str]:
    """The package's modules loaded in this process without the marks."""
    return [
        name
        for name, module in list(sys.modules.items())
        if (name == package or name.startswith(package + "."))
        and not (
            isinstance(module, ModuleType)
            and MARK in ModuleType.__getattribute__(module, "__dict__")
        )
    ]
