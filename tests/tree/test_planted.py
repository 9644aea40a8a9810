"""A symlink planted where `apply`, `apply --revert` or `materialize` writes:
before the command, and at every step of its write (the fault tests'
injection points). Nothing is ever written through it: the file it points
to is untouched, no file appears where a dangling one points, and the
command either completes exactly or refuses with one line naming the link
and leaves every file as it was. Issue 41, findings 1 and 2.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faketree import (
    COMMON,
    CONNECTOR,
    FakeTree,
    cheap_cli_writes,
    reference_states,
)
from vllm_overlay import transaction
from vllm_overlay.cli import main
from vllm_overlay.series.pin import MODULE_DIR
from vllm_overlay.transaction import JOURNAL_NAME, LOCK_NAME
from vllm_overlay.tree.manifest import MANIFEST_NAME


@pytest.fixture(autouse=True)
def _cheap_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    cheap_cli_writes(monkeypatch)  # the commands here run some 1200 times


STATES = reference_states(Path(tempfile.mkdtemp(prefix="vllm-overlay-planted-")))
PINNED = [Path(COMMON).name, Path(CONNECTOR).name]
# Every path of the module directory a write creates, replaces or removes.
OWN = [
    LOCK_NAME,
    JOURNAL_NAME,
    JOURNAL_NAME + ".tmp",
    MANIFEST_NAME,
    *(
        f".{name}{suffix}"
        for name in [MANIFEST_NAME, *PINNED]
        for suffix in (
            ".overlay-new",
            ".overlay-old",
        )
    ),
]
NAMES = OWN + PINNED
VICTIM = b"a file outside the target\n"

# What a path holds: (bytes, mode) for a regular file, ("->", target) for a
# symlink.
Entry = tuple[object, object]


def _lsnap(directory: Path) -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if p.is_symlink():
            out[rel] = ("->", os.readlink(p))
        elif p.is_file():
            out[rel] = (p.read_bytes(), p.stat().st_mode & 0o7777)
    return out


def _regular(snap: dict[str, Entry]) -> dict[str, Entry]:
    return {k: v for k, v in snap.items() if v[0] != "->"}


class Outside:
    """A file outside the target, and a path outside where none exists."""

    def __init__(self, root: Path, content: bytes = VICTIM):
        root.mkdir()
        self.content = content
        self.victim = root / "victim.txt"
        self.victim.write_bytes(content)
        self.dangling = root / "created-through-a-link.txt"

    def target(self, kind: str) -> Path:
        return self.victim if kind == "victim" else self.dangling

    def assert_untouched(self) -> None:
        assert self.victim.read_bytes() == self.content
        assert not self.dangling.exists()


def _plant(path: Path, to: Path) -> None:
    if path.is_symlink() or path.exists():
        path.unlink()
    path.symlink_to(to)


def _start(tree: FakeTree, command: str) -> dict[str, Entry]:
    if command == "revert":
        assert tree.cli("apply") == 0
    return _lsnap(tree.module)


def _end(command: str) -> dict[str, Entry]:
    return dict(STATES.overlay if command == "apply" else STATES.base)


def _one_line_naming(err: str, name: str) -> None:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert name in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", ["victim", "dangling"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("command", ["apply", "revert"])
def test_link_planted_before_is_refused_and_changes_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    name: str,
    kind: str,
) -> None:
    tree = FakeTree.create(tmp_path / "t")
    _start(tree, command)
    # A link in a file's place points to the same bytes elsewhere: nothing
    # tells it apart but being a link.
    path = tree.module / name
    outside = Outside(
        tmp_path / "outside", path.read_bytes() if path.exists() else VICTIM
    )
    _plant(path, outside.target(kind))
    before = _lsnap(tree.module)
    capsys.readouterr()
    assert tree.cli(command) == 2
    _one_line_naming(capsys.readouterr().err, name)
    outside.assert_untouched()
    assert _lsnap(tree.module) == before


def test_lock_hard_linked_to_a_file_elsewhere_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hard link (same file system) would be truncated as surely as a
    symlink's target."""
    outside = Outside(tmp_path / "outside")
    tree = FakeTree.create(tmp_path / "t")
    os.link(outside.victim, tree.module / LOCK_NAME)
    before = _lsnap(tree.module)
    assert tree.cli("apply") == 2
    err = capsys.readouterr().err
    _one_line_naming(err, LOCK_NAME)
    assert "hard link" in err
    outside.assert_untouched()
    assert _lsnap(tree.module) == before


def _plant_at(step: int, path: Path, to: Path) -> Callable[[str], None]:
    """A fault hook planting a symlink at ``path`` before step ``step``."""
    seen = {"n": 0}

    def hook(_name: str) -> None:
        seen["n"] += 1
        if seen["n"] == step:
            _plant(path, to)

    return hook


def _steps(command: str) -> int:
    return len(STATES.apply_steps if command == "apply" else STATES.revert_steps)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("command", ["apply", "revert"])
def test_link_planted_at_every_step_is_never_written_through(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    name: str,
) -> None:
    """At step N of the write, whatever stands at ``name`` (ours, or
    nothing) is replaced by a symlink (to a file outside at odd steps, to
    where none exists at even ones). Then: completed exactly (exit 0) or
    refused naming the link with every file as it was (exit 2); the link is
    never written through. Once the link is gone, one more run of the
    command reaches its end state exactly."""
    end = _end(command)
    for step in range(1, _steps(command) + 1):
        outside = Outside(tmp_path / f"outside-{step}")
        tree = FakeTree.create(tmp_path / str(step))
        before = _start(tree, command)
        to = outside.target("victim" if step % 2 else "dangling")
        monkeypatch.setattr(
            transaction, "_fault_hook", _plant_at(step, tree.module / name, to)
        )
        capsys.readouterr()
        code = tree.cli(command)
        monkeypatch.setattr(transaction, "_fault_hook", None)
        err = capsys.readouterr().err
        where = f"{command} at step {step}: {err}"
        outside.assert_untouched()
        now = _lsnap(tree.module)
        expected = end if code == 0 else before
        if code == 2:
            _one_line_naming(err, name)
        else:
            assert code == 0, where
        # Every file but the one the link took the place of is exactly as
        # expected; that one is the link or its expected content.
        for path in set(_regular(now)) | set(_regular(expected)):
            if path != name:
                assert now.get(path) == expected.get(path), (where, path)
        if name in _regular(now):
            assert now[name] == expected.get(name), where
        if name in PINNED:
            continue  # the link took a pinned file's place: nothing to recover
        for p in tree.module.iterdir():
            if p.is_symlink():
                p.unlink()
        assert tree.cli(command) == 0, (where, capsys.readouterr().err)
        assert _lsnap(tree.module) == end, where


def _move_module(tree: FakeTree, real: Path) -> None:
    """The module directory becomes a symlink to ``real``."""
    shutil.move(tree.module, real)
    tree.module.symlink_to(real)


def test_symlinked_module_is_resolved_once_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = FakeTree.create(tmp_path / "t")
    real = tmp_path / "real-moriio"
    _move_module(tree, real)
    capsys.readouterr()
    assert tree.cli("apply") == 0
    out = capsys.readouterr().out
    assert f"{tree.module} resolves to {real} through a symlink" in out
    assert tree.module.is_symlink()
    assert _lsnap(real) == STATES.overlay
    assert tree.cli("revert") == 0
    assert _lsnap(real) == STATES.base


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_module_link_switched_during_the_write_changes_nothing_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """The module symlink re-pointed at another copy of the module in the
    middle of the write: every write still lands in the directory resolved
    at the start, which ends exactly overlaid (or reverted)."""
    tree = FakeTree.create(tmp_path / "t")
    _start(tree, command)
    real, other = tmp_path / "real-moriio", tmp_path / "other-moriio"
    _move_module(tree, real)
    shutil.copytree(real, other, symlinks=True)
    other_before = _lsnap(other)
    steps = STATES.apply_steps if command == "apply" else STATES.revert_steps
    # After the journal, before the first new file.
    switch_at = next(s for s in steps if s.startswith("write ") and "journal" not in s)

    def switch(step: str) -> None:
        if step == switch_at:
            tree.module.unlink()
            tree.module.symlink_to(other)

    monkeypatch.setattr(transaction, "_fault_hook", switch)
    assert tree.cli(command) == 0
    monkeypatch.setattr(transaction, "_fault_hook", None)
    assert _lsnap(real) == _end(command)
    assert _lsnap(other) == other_before


# -- materialize ----------------------------------------------------------------


@pytest.mark.parametrize(
    "link",
    [
        f"{MODULE_DIR}/moriio_connector.py",
        f"{MODULE_DIR}/.moriio_connector.py.overlay-new",
        "vllm",
        MODULE_DIR,
    ],
)
def test_materialize_refuses_a_link_below_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], link: str
) -> None:
    tree = FakeTree.create(tmp_path / "t")
    outside = Outside(tmp_path / "outside")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    (out / link).parent.mkdir(parents=True)
    to = elsewhere if (out / link).name in ("vllm", "moriio") else outside.victim
    (out / link).symlink_to(to)
    argv = ["--repo", str(tree.repo), "materialize", "--from", str(tree.vllm)]
    capsys.readouterr()
    assert main([*argv, "--out", str(out)]) == 2
    _one_line_naming(capsys.readouterr().err, str(out / link))
    outside.assert_untouched()
    assert list(elsewhere.iterdir()) == []
    assert not [p for p in out.rglob("*") if p.is_file() and not p.is_symlink()]


def test_materialize_replaces_its_own_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second materialize into the same directory replaces the files it
    wrote (regular files), keeping nothing of the first run's bytes."""
    tree = FakeTree.create(tmp_path / "t")
    out = tmp_path / "out"
    argv = ["--repo", str(tree.repo), "materialize", "--from", str(tree.vllm)]
    assert main([*argv, "--base", "--out", str(out)]) == 0
    base = _lsnap(out)
    assert main([*argv, "--out", str(out)]) == 0
    overlaid = _lsnap(out)
    assert overlaid != base
    assert {k: v[0] for k, v in overlaid.items()} == {
        f"{MODULE_DIR}/{k}": v[0]
        for k, v in STATES.overlay.items()
        if not k.startswith(".")
    }


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_backups_are_copies_where_hard_links_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """A file system without hard links: each backup is a copy (created
    exclusively, mode kept), and a failure at the last rename is undone from
    the copies exactly."""

    def no_links(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    tree = FakeTree.create(tmp_path / "t")
    before = _start(tree, command)
    steps = STATES.apply_steps if command == "apply" else STATES.revert_steps
    last_rename = steps[steps.index("fsync dir after renames") - 1]

    def fail(step: str) -> None:
        if step == last_rename:
            raise OSError(errno.EIO, "Input/output error", step)

    monkeypatch.setattr(transaction, "_fault_hook", fail)
    assert tree.cli(command) == 2
    assert _lsnap(tree.module) == before
    monkeypatch.setattr(transaction, "_fault_hook", None)
    assert tree.cli(command) == 0
    assert _lsnap(tree.module) == _end(command)
