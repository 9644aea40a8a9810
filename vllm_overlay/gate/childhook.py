"""An audit hook that notes every read of vLLM's installed MoRIIO package.

Standard library only: `vllm_overlay.gate.touch` installs it in the pytest
process and copies this file as ``sitecustomize.py`` onto the
``PYTHONPATH`` of every child Python a test starts, so a child's reads are
noted too; beside it, a copy of `vllm_overlay.gate.runmark` (``RUNMARK``)
that a child installs too, so what runs of the package there is noted. A
note is one line appended to the log (``TOUCH_LOG``): the scope running at
the time (``TOUCH_SCOPE``, a test id, a fixture or a collector, set by the
plugin), a tab, the process id, the event and path. Only the first read per
process and scope is written, and a child's first mark.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

TOUCH_LOG = "VLLM_OVERLAY_TOUCH_LOG"  # the log file (append)
TOUCH_DIRS = "VLLM_OVERLAY_TOUCH_DIRS"  # the installed package, os.pathsep-separated
TOUCH_SCOPE = "VLLM_OVERLAY_TOUCH_SCOPE"  # what is running: the scope of a note
TOUCH_PACKAGE = "VLLM_OVERLAY_TOUCH_PACKAGE"  # the package marked (a module name)
TOUCH_CODE = "VLLM_OVERLAY_TOUCH_CODE"  # where the marked code is cached
RUNMARK = "_vllm_overlay_runmark"  # the copy of runmark beside this one
# A path is checked against TOUCH_DIRS only when it holds this (cheap filter).
MARK = "moriio"
EVENTS = ("open", "os.listdir", "os.scandir", "shutil.copytree", "shutil.rmtree")


def _path(event: str, args: tuple[Any, ...]) -> str | None:
    if not args:
        return None
    path = args[0]
    if path is None:
        return os.getcwd() if event in ("os.listdir", "os.scandir") else None
    if isinstance(path, int):
        return None
    try:
        return os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return None


def make_hook(
    log: str, dirs: tuple[str, ...], scope: Callable[[], str]
) -> Callable[[str, tuple[Any, ...]], None]:
    """The audit hook: a note in ``log`` for a read under one of ``dirs``."""
    seen: set[str] = set()
    busy = [False]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if busy[0] or event not in EVENTS:
            return
        path = _path(event, args)
        if path is None or MARK not in path:
            return
        busy[0] = True  # the realpath and the note below raise events too
        try:
            real = os.path.realpath(path)
            inside = any(
                p == d or p.startswith(d + os.sep) for d in dirs for p in (path, real)
            )
            where = scope()
            if inside and where not in seen:
                seen.add(where)
                append(log, where, event, path)
        finally:
            busy[0] = False

    return hook


def append(log: str, scope: str, event: str, what: str) -> None:
    """One note in ``log``."""
    line = f"{scope}\t{os.getpid()} {event} {what}\n".encode()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def install_from_env() -> bool:
    """Install the hook from the environment (a child process); False when
    the environment names no log."""
    log = os.environ.get(TOUCH_LOG)
    dirs = tuple(d for d in os.environ.get(TOUCH_DIRS, "").split(os.pathsep) if d)
    if not log or not dirs:
        return False

    def scope() -> str:
        return os.environ.get(TOUCH_SCOPE, "?")

    sys.addaudithook(make_hook(log, dirs, scope))
    package = os.environ.get(TOUCH_PACKAGE)
    if package:
        _install_marks(log, package, scope)
    return True


def _install_marks(log: str, package: str, scope: Callable[[], str]) -> None:
    """Note the first mark of the package in this process (its scope is
    the one it was started in)."""
    try:
        runmark = importlib.import_module(RUNMARK)
    except ImportError:
        return

    def note(event: str, what: str) -> bool:
        append(log, scope(), event, what)
        return False

    runmark.install(package, note, os.environ.get(TOUCH_CODE, ""))


def _chain_sitecustomize() -> None:
    """Run the ``sitecustomize`` this copy shadows, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    module = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if module is not None:
            sys.modules["sitecustomize"] = module


if __name__ == "sitecustomize":  # a child process, through PYTHONPATH
    install_from_env()
    _chain_sitecustomize()
