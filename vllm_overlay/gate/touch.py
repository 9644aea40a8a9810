"""A pytest plugin that records which tests read vLLM's installed MoRIIO package.

``-p vllm_overlay.gate.touch --touch-json PATH``: the evidence that picks the
tests `nox -s unit-base` runs on the pinned base. The base and the overlay
differ only inside the installed MoRIIO package (the files the series
touches and its manifest), so a test can change outcome between them only
if something it runs reads that directory. For each test the plugin writes
why it may (an empty list: it cannot):

- ``read``: the test, in this process or in a child Python, opened or listed
  a path under the package (an audit hook; children get it as
  ``sitecustomize`` on their ``PYTHONPATH``, `vllm_overlay.gate.childhook`);
- ``fixture NAME@NODE``: a fixture it uses read there when it was set up
  (once per scope: a session fixture's read counts for every test using it);
- ``collected NODE``: importing its module, package or a conftest read there
  (``collected (start-up)``: before collection, for every test);
- ``ran``: code of the package ran while the test ran, in this process, a
  thread, or a child (`vllm_overlay.gate.runmark`: the package's modules
  are compiled with a mark at the entry of every function);
- ``used``: a value of the package's modules was looked up while the test
  ran (``from ... import NAME``, ``module.NAME``, an import of a module
  already loaded). A fixture's or collector's run or lookup counts as its
  read;
- ``unmarked``: a module of the package was loaded in this process without
  the marks (before the plugin, or by a loader of its own): what it runs is
  unseen;
- ``untracked child``: it (or a fixture it uses) started a process whose
  environment drops the hook, whose reads would go unseen.

A test that only had the package's modules in its process (imported by
another test or a collector), and neither read, ran nor looked up anything
of them, cannot change outcome between base and overlay: it is listed in
``loaded`` (not a reason; the gate's sample of the untouched tests takes half
of it, as a check of this evidence).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from vllm_overlay.gate import childhook, runmark
from vllm_overlay.gate.evidence import Touches, encode
from vllm_overlay.series.pin import MODULE_PACKAGE
from vllm_overlay.tree.variant import installed_moriio_dir

OPTION = "--touch-json"
STARTUP = "startup"
SPAWN_EVENTS = ("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn")
COLLECT = "collect "
CODE_CACHE = ".nox-cache/marked-code"
# The notes of the marks, by event: the others are reads.
MARKED = {runmark.RAN: "ran", runmark.USED: "used"}


def moriio_loaded() -> bool:
    return any(
        m == MODULE_PACKAGE or m.startswith(MODULE_PACKAGE + ".") for m in sys.modules
    )


def watched_dirs() -> tuple[str, ...]:
    """The installed MoRIIO package, as found and resolved (without importing
    vLLM)."""

    found = str(installed_moriio_dir())
    return tuple(dict.fromkeys([os.path.abspath(found), os.path.realpath(found)]))


def read_log(path: Path) -> dict[str, list[str]]:
    """Scope -> notes, from the hook's log."""
    notes: dict[str, list[str]] = {}
    if not path.is_file():
        return notes
    for line in path.read_text(errors="replace").splitlines():
        scope, _, note = line.partition("\t")
        notes.setdefault(scope, []).append(note)
    return notes


def fixture_scope(argname: str, baseid: str) -> str:
    return f"fixture {argname}@{baseid}"


def tracked(env: object, log: str, hook_dir: str) -> bool:
    """Whether a child started with ``env`` (None: this process's) runs the
    hook."""
    source = os.environ if env is None else env
    if not isinstance(source, Mapping):
        return False
    paths = str(source.get("PYTHONPATH", "")).split(os.pathsep)
    return source.get(childhook.TOUCH_LOG) == log and hook_dir in paths


def covers(node: str, test: str) -> bool:
    """Whether collector ``node`` (a directory, module or class) holds ``test``."""
    return not node or node in (".", test) or test.startswith((node + "::", node + "/"))


class Recorder:
    """The audit hooks and the scope they note; `reasons` per test."""

    def __init__(self, path: Path, dirs: tuple[str, ...], root: Path, tests: Path):
        self.path = path
        self.root, self.tests = root, tests
        self.dirs = dirs
        self.work = Path(tempfile.mkdtemp(prefix="touch-"))
        self.log = str(self.work / "touch.log")
        self.hook_dir = str(self.work / "hook")
        os.mkdir(self.hook_dir)
        shutil.copyfile(childhook.__file__, Path(self.hook_dir, "sitecustomize.py"))
        marks = Path(self.hook_dir, childhook.RUNMARK + ".py")
        shutil.copyfile(runmark.__file__, marks)
        # The marked code, shared with children and later runs (keyed by
        # source, path, Python and the marks' own text).
        self.code = str(root / CODE_CACHE)
        self.scope = STARTUP
        self.untracked: set[str] = set()
        self.unmarked: set[str] = set()
        self.loaded: set[str] = set()
        self.marked: set[str] = set()  # the scopes a mark was noted in
        self.arm: Callable[[], None] | None = None
        self.fixtures: dict[str, list[str]] = {}  # test id -> fixture scopes
        self.ran: list[str] = []

    def start(self) -> None:
        os.environ[childhook.TOUCH_LOG] = self.log
        os.environ[childhook.TOUCH_DIRS] = os.pathsep.join(self.dirs)
        os.environ[childhook.TOUCH_PACKAGE] = MODULE_PACKAGE
        os.environ[childhook.TOUCH_CODE] = self.code
        paths = [self.hook_dir, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self._set(STARTUP)
        sys.addaudithook(childhook.make_hook(self.log, self.dirs, self._where))
        sys.addaudithook(self._spawn_hook)
        self.arm = runmark.install(MODULE_PACKAGE, self._mark, self.code)

    def _collecting(self) -> bool:
        return self.scope == STARTUP or self.scope.startswith(COLLECT)

    def _mark(self, event: str, what: str) -> bool:
        """A mark's note, once per scope; armed on while collecting (the
        scope of a note is then the module being imported)."""
        where = self._where()
        if where not in self.marked:
            self.marked.add(where)
            childhook.append(self.log, where, event, what)
        return self._collecting()

    def _where(self) -> str:
        """The scope of a read: while collecting, the outermost module under
        the test directory being imported (a conftest: its directory)."""
        if self.scope != STARTUP and not self.scope.startswith(COLLECT):
            return self.scope
        frame: FrameType | None = sys._getframe(1)
        outermost: Path | None = None
        while frame is not None:
            if frame.f_code.co_name == "<module>":
                path = Path(frame.f_code.co_filename)
                # Not pytest's own `__main__` in a venv inside the checkout.
                if (
                    path.is_relative_to(self.tests)
                    and "site-packages" not in path.parts
                ):
                    outermost = path
            frame = frame.f_back
        if outermost is None:
            return self.scope
        node = outermost.parent if outermost.name == "conftest.py" else outermost
        return COLLECT + node.relative_to(self.root).as_posix()

    def _set(self, scope: str) -> str:
        previous, self.scope = self.scope, scope
        os.environ[childhook.TOUCH_SCOPE] = scope
        if self.arm is not None:
            self.arm()
        return previous

    def _spawn_hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event in SPAWN_EVENTS and not tracked(
            args[-1] if args else None, self.log, self.hook_dir
        ):
            self.untracked.add(self.scope)

    def _during(self, scope: str) -> Generator[None, Any, Any]:
        previous = self._set(scope)
        try:
            return (yield)
        finally:
            self._set(previous)

    # -- pytest hooks ---------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, Any, Any]:
        return (yield from self._during(COLLECT + collector.nodeid))

    @pytest.hookimpl(wrapper=True)
    def pytest_collect_directory(
        self, path: Path, parent: pytest.Collector
    ) -> Generator[None, Any, Any]:
        # A directory's conftest loads here or in its collect report.
        node = Path(path).relative_to(parent.config.rootpath).as_posix()
        return (yield from self._during(COLLECT + node))

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[Any]
    ) -> Generator[None, Any, Any]:
        scope = fixture_scope(fixturedef.argname, fixturedef.baseid)
        return (yield from self._during(scope))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, Any, Any]:
        info = getattr(item, "_fixtureinfo", None)
        defs = getattr(info, "name2fixturedefs", {}) or {}
        self.fixtures[item.nodeid] = [
            fixture_scope(d.argname, d.baseid) for ds in defs.values() for d in ds
        ]
        result = yield from self._during(item.nodeid)
        self.ran.append(item.nodeid)
        if moriio_loaded():
            self.loaded.add(item.nodeid)
            if runmark.unmarked(MODULE_PACKAGE):
                self.unmarked.add(item.nodeid)
        return result

    def pytest_sessionfinish(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        reasons = self.reasons()
        loaded = sorted(t for t in self.loaded if not reasons.get(t))
        self.path.write_bytes(encode(Touches(list(self.dirs), reasons, loaded)))
        shutil.rmtree(self.work, ignore_errors=True)

    def reasons(self) -> dict[str, list[str]]:
        notes = read_log(Path(self.log))
        scopes = set(notes) | self.untracked
        collected = sorted(s for s in scopes if s.startswith(COLLECT))
        result: dict[str, list[str]] = {}
        for test in self.ran:
            why: list[str] = []
            if STARTUP in scopes:
                why.append("collected (start-up)")
            why.extend(
                "collected " + s.removeprefix(COLLECT)
                for s in collected
                if covers(s.removeprefix(COLLECT), test)
            )
            why.extend(s for s in self.fixtures.get(test, []) if s in scopes)
            events = {n.split(" ", 2)[1] for n in notes.get(test, [])}
            if events - set(MARKED):
                why.append("read")
            why.extend(MARKED[e] for e in MARKED if e in events)
            if test in self.unmarked:
                why.append("unmarked")
            if test in self.untracked:
                why.append("untracked child")
            result[test] = why
        return result


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION, default=None, type=Path, help="write which tests read vLLM's MoRIIO"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before any conftest: they may import vLLM.
    path = early_config.known_args_namespace.touch_json
    if path is not None:
        root = early_config.rootpath
        tests = [root / p for p in early_config.getini("testpaths")] or [root]
        recorder = Recorder(path.resolve(), watched_dirs(), root, tests[0])
        recorder.start()
        early_config.pluginmanager.register(recorder, "touch-recorder")
