"""A small fake vLLM tree and overlay checkout, and a driver that kills the
CLI at one step of a write: the fault-injection tests' pieces.

The fake MoRIIO module holds three short files (one read-only, one mode 640)
under the real module path; the series has two patches, one touching two
files. Everything is a few hundred bytes, so a run costs only the Python
start-up of the process that gets killed.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from tests.repo import REPO
from tests.workspace import fake_site, make_diff, patch_header
from vllm_overlay import cli
from vllm_overlay.cli import main
from vllm_overlay.series.pin import (
    MODULE_DIR,
    PIN_FILE,
    Pin,
    encode_pin,
    load_pin,
    sha256_bytes,
)

CONNECTOR = f"{MODULE_DIR}/moriio_connector.py"
COMMON = f"{MODULE_DIR}/moriio_common.py"
INIT = f"{MODULE_DIR}/__init__.py"
BASE_TEXTS = {
    INIT: "",
    CONNECTOR: "".join(f"connector line {i}\n" for i in range(1, 41)),
    COMMON: "".join(f"common line {i}\n" for i in range(1, 21)),
}
MODES = {INIT: 0o644, CONNECTOR: 0o444, COMMON: 0o640}

# A process that imports the CLI once, then for each request (a JSON line:
# argv, the step to signal at, the signal, files for stdout/stderr) forks a
# child that runs the CLI and sends itself the signal at that step of any
# transaction (counted over the whole run); it answers with the child's exit
# status (-9: killed). A fork costs milliseconds where a new Python costs a
# second: every kill point stays cheap.
ZYGOTE = """
import json, os, signal, sys
from vllm_overlay import transaction
from vllm_overlay.cli import main
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, req["out"]), (2, req["err"])):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        seen = 0
        def hook(step):
            global seen
            seen += 1
            if seen == req["at"]:
                os.kill(os.getpid(), getattr(signal, req["sig"]))
        transaction._fault_hook = hook
        code = main(req["argv"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


_PARSER = functools.cache(cli.build_parser)


def cheap_cli_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests that run the CLI hundreds of times in this process: one
    argument parser for all of them, and fsync a no-op. Every step of a
    write, fault hook included, is still taken: what such tests check is
    where bytes land, not that they reached the disk."""
    monkeypatch.setattr(cli, "build_parser", _PARSER)
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


class Zygote:
    """The forking runner (one per test process, started on first use)."""

    _proc: subprocess.Popen[str] | None = None

    @classmethod
    def run(cls, argv: list[str], at: int, sig: str, scratch: Path) -> Run:
        if cls._proc is None or cls._proc.poll() is not None:
            cls._proc = subprocess.Popen(
                [sys.executable, "-c", ZYGOTE],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            atexit.register(cls._proc.kill)
        assert cls._proc.stdin is not None and cls._proc.stdout is not None
        out, err = scratch / "child.out", scratch / "child.err"
        request = {"argv": argv, "at": at, "sig": sig, "out": str(out), "err": str(err)}
        cls._proc.stdin.write(json.dumps(request) + "\n")
        cls._proc.stdin.flush()
        code = int(cls._proc.stdout.readline())
        return Run(code, out.read_text(), err.read_text())


# Runs the CLI and, at the first step named ARGV[1], writes ARGV[2] and waits
# until ARGV[3] exists: a writer caught holding the lock mid-commit.
PAUSE_DRIVER = """
import pathlib, sys, time
from vllm_overlay import transaction
from vllm_overlay.cli import main
step, ready, go = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
def hook(name):
    if name == step and not ready.exists():
        ready.write_text("paused")
        while not go.exists():
            time.sleep(0.01)
transaction._fault_hook = hook
sys.exit(main(sys.argv[4:]))
"""


def _edit(text: str, line: str, new: str) -> str:
    assert text.count(line) == 1
    return text.replace(line, new)


def patch_text(name: str, diffs: list[str]) -> str:
    return patch_header(name) + "---\n" + "".join(diffs)


def series_patches() -> dict[str, str]:
    """0001 edits both files, 0002 the connector again."""
    conn1 = _edit(BASE_TEXTS[CONNECTOR], "connector line 10\n", "connector LINE 10\n")
    common1 = _edit(BASE_TEXTS[COMMON], "common line 5\n", "common line 5\n# +\n")
    conn2 = _edit(conn1, "connector line 30\n", "# 0002\nconnector line 30\n")
    return {
        "0001-both.patch": patch_text(
            "0001-both.patch",
            [
                make_diff(COMMON, BASE_TEXTS[COMMON], common1),
                make_diff(CONNECTOR, BASE_TEXTS[CONNECTOR], conn1),
            ],
        ),
        "0002-connector.patch": patch_text(
            "0002-connector.patch", [make_diff(CONNECTOR, conn1, conn2)]
        ),
    }


Snapshot = dict[str, tuple[bytes, int]]


@dataclass
class FakeTree:
    repo: Path  # the overlay checkout
    site: Path  # plays site-packages: holds vllm/

    @classmethod
    def create(cls, root: Path, patches: dict[str, str] | None = None) -> FakeTree:
        repo, site = root / "repo", root / "site"
        (repo / "patches").mkdir(parents=True)
        (repo / "tests" / "overlay").mkdir(parents=True)
        (repo / "tests" / "overlay" / "conftest.py").write_text("")
        real = load_pin(REPO / PIN_FILE)
        files = {p: sha256_bytes(t.encode()) for p, t in BASE_TEXTS.items()}
        pin = Pin(vllm=real.vllm, image=real.image, module=MODULE_DIR, files=files)
        (repo / PIN_FILE).write_text(encode_pin(pin))
        patches = series_patches() if patches is None else patches
        for name, text in patches.items():
            (repo / "patches" / name).write_text(text)
        (repo / "patches" / "series").write_text("".join(f"{n}\n" for n in patches))
        fake_site(site, BASE_TEXTS)
        for path in BASE_TEXTS:
            (site / path).chmod(MODES[path])
        return cls(repo, site)

    @property
    def vllm(self) -> Path:
        return self.site / "vllm"

    @property
    def module(self) -> Path:
        return self.site / MODULE_DIR

    def argv(self, command: str, *extra: str) -> list[str]:
        """CLI arguments: ``apply``, ``revert`` or ``status`` on this tree."""
        if command == "revert":
            command, extra = "apply", ("--revert", *extra)
        return ["--repo", str(self.repo), command, "--target", str(self.vllm), *extra]

    def cli(self, command: str, *extra: str) -> int:
        return main(self.argv(command, *extra))

    def snapshot(self) -> Snapshot:
        """Every file of the module directory (dot files included): bytes
        and mode."""
        return {
            p.relative_to(self.module).as_posix(): (
                p.read_bytes(),
                p.stat().st_mode & 0o7777,
            )
            for p in sorted(self.module.rglob("*"))
            if p.is_file()
        }

    def copy(self, dest: Path) -> FakeTree:
        """A copy of checkout and tree, modes and hard links within it kept."""
        for part in (self.repo, self.site):
            seen: dict[tuple[int, int], Path] = {}
            for src in sorted(part.rglob("*")):
                to = dest / part.name / src.relative_to(part)
                st = src.lstat()
                if src.is_dir():
                    to.mkdir(parents=True, exist_ok=True)
                elif (st.st_dev, st.st_ino) in seen:
                    os.link(seen[(st.st_dev, st.st_ino)], to)
                else:
                    to.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, to)
                    seen[(st.st_dev, st.st_ino)] = to
        return FakeTree(dest / self.repo.name, dest / self.site.name)

    def kill_at(self, command: str, step: int, sig: str = "SIGKILL") -> Run:
        """Run ``command`` in a child that sends itself ``sig`` at ``step``."""
        scratch = self.site.parent
        return Zygote.run(self.argv(command), step, sig, scratch)


def recorded_steps(tree: FakeTree, command: str) -> list[str]:
    """The transaction steps ``command`` takes on ``tree`` (which it changes)."""
    from vllm_overlay import transaction

    steps: list[str] = []
    transaction._fault_hook = steps.append
    try:
        assert tree.cli(command) == 0
    finally:
        transaction._fault_hook = None
    return steps


@dataclass(frozen=True)
class States:
    """The two states a recovery may reach: exactly these bytes and modes."""

    base: Snapshot
    overlay: Snapshot
    apply_steps: list[str]  # apply on the base
    revert_steps: list[str]  # revert of the overlay


def reference_states(root: Path) -> States:
    tree = FakeTree.create(root)
    base = tree.snapshot()
    apply_steps = recorded_steps(tree, "apply")
    overlay = tree.snapshot()
    revert_steps = recorded_steps(tree, "revert")
    assert tree.snapshot() == base
    shutil.rmtree(root)
    return States(base, overlay, apply_steps, revert_steps)


def json_of(out: str) -> dict[str, object]:
    """The one JSON object a ``--json`` run printed."""
    value = msgspec.json.decode(out.encode())
    assert isinstance(value, dict)
    return value
