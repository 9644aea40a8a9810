"""The marks compiled into vLLM's MoRIIO package: where they go, what they
note, and that the marked code reads as written (docstrings, line numbers,
source)."""

from __future__ import annotations

import inspect
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

import pytest

from vllm_overlay.gate import runmark
from vllm_overlay.tree.variant import installed_moriio_dir

SOURCE = textwrap.dedent(
    '''
    def plain(x):
        """Doc."""
        return x + 1


    def only_doc():
        """Nothing else."""


    def gen():
        try:
            yield 1
            yield 2
        finally:
            pass


    def boom():
        raise ValueError("here")
    '''
)


def _load(tmp_path: Path) -> tuple[dict[str, Any], list[str], Any]:
    path = tmp_path / "module.py"
    path.write_text(SOURCE)
    marks = runmark.Marks("pkg")
    notes: list[str] = []

    def note(event: str, what: str) -> bool:
        notes.append(f"{event} {what.rpartition(':')[2]}")
        return False

    arm = marks.listen(note)
    namespace: dict[str, Any] = {runmark.MARK: marks, "__name__": "module"}
    exec(runmark.mark_source(SOURCE.encode(), str(path)), namespace)
    return namespace, notes, arm


def test_a_mark_notes_once_per_scope_at_entry_and_resume(tmp_path: Path) -> None:
    ns, notes, arm = _load(tmp_path)
    assert notes == []  # the module's own code is not a call
    assert ns["plain"](1) == 2 and ns["plain"](2) == 3
    assert notes == ["ran plain"]  # disarmed until the next scope
    arm()
    g = ns["gen"]()
    assert next(g) == 1
    arm()
    assert next(g) == 2  # resumed in a new scope
    arm()
    g.close()  # the finally around the yield
    assert notes == ["ran plain", "ran gen", "ran gen", "ran gen"]


def test_the_marked_code_reads_as_written(tmp_path: Path) -> None:
    ns, _, _ = _load(tmp_path)
    assert ns["plain"].__doc__ == "Doc." and ns["only_doc"].__doc__ == "Nothing else."
    assert ns["only_doc"]() is None
    assert inspect.getsource(ns["plain"]).startswith("def plain(x):")
    with pytest.raises(ValueError) as raised:
        ns["boom"]()
    frame = traceback.extract_tb(raised.tb)[-1]
    assert frame.lineno == SOURCE.splitlines().index('    raise ValueError("here")') + 1
    assert frame.line == 'raise ValueError("here")'


def _codes(code: CodeType) -> Iterator[CodeType]:
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield const
            yield from _codes(const)


def test_every_function_of_the_installed_package_keeps_its_lines() -> None:
    """Each installed module, marked: the same code on the same lines, and a
    mark in every function and method (lambdas and comprehensions aside)."""
    for path in sorted(installed_moriio_dir().glob("*.py")):
        source = path.read_bytes()
        plain = compile(source, str(path), "exec", dont_inherit=True)
        marked = runmark.mark_source(source, str(path))
        lines = [(c.co_qualname, c.co_firstlineno) for c in _codes(marked)]
        assert lines == [(c.co_qualname, c.co_firstlineno) for c in _codes(plain)]
        for code in _codes(marked):
            function = code.co_flags & inspect.CO_OPTIMIZED
            if function and "<" not in code.co_qualname:
                assert runmark.MARK in code.co_names, (path.name, code.co_qualname)


def test_a_module_keeps_its_class_and_notes_lookups_while_armed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A marked module is a `WatchedModule` for good: a lookup is noted
    while a listener is armed (the note disarms it) and not after; arming
    again notes again, the module's class never swapped."""
    marks = runmark.Marks("pkg")
    monkeypatch.setattr(runmark, "MARKS", [marks])
    module = ModuleType("pkg.mod")
    module.x = 1  # type: ignore[attr-defined]
    marks.add(module)
    seen: list[tuple[str, str]] = []
    arm = marks.listen(lambda event, what: bool(seen.append((event, what))))
    assert type(module) is runmark.WatchedModule
    assert module.x == 1  # type: ignore[attr-defined]
    assert module.x == 1  # type: ignore[attr-defined]
    assert seen == [(runmark.USED, "pkg.mod.x")]
    assert type(module) is runmark.WatchedModule
    arm()
    assert module.x == 1  # type: ignore[attr-defined]
    assert seen == [(runmark.USED, "pkg.mod.x")] * 2
    assert type(module) is runmark.WatchedModule
