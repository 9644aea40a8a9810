"""Fault injection: apply and revert killed at every step of their write,
interrupted by SIGINT/SIGTERM, failing with ENOSPC, racing each other.

Each case asserts the exact bytes and modes of every file in the module
directory afterwards (manifest included, nothing left over), and that one
command alone -- `apply` or `apply --revert` -- reaches exactly the overlay
or exactly the base from whatever a kill left.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.faketree import (
    PAUSE_DRIVER,
    FakeTree,
    Snapshot,
    cheap_cli_writes,
    recorded_steps,
    reference_states,
)
from tests.repo import REPO
from vllm_overlay import transaction
from vllm_overlay.checkout import Checkout
from vllm_overlay.series.patch_series import Series
from vllm_overlay.series.pin import Pin
from vllm_overlay.transaction import JOURNAL_NAME, LOCK_NAME
from vllm_overlay.tree.apply import ApplyError, apply_series, revert_series
from vllm_overlay.tree.status import tree_status
from vllm_overlay.tree.target import Target, detect_target


@pytest.fixture(autouse=True)
def _cheap_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    cheap_cli_writes(monkeypatch)  # the in-process writes here


STATES = reference_states(Path(tempfile.mkdtemp(prefix="vllm-overlay-faults-")))
# Every step of each write, by number (1 = before the first step).
KILL_POINTS = [("apply", n) for n in range(1, len(STATES.apply_steps) + 1)] + [
    ("revert", n) for n in range(1, len(STATES.revert_steps) + 1)
]


def _start(tree: FakeTree, command: str) -> Snapshot:
    """Bring ``tree`` to where ``command`` starts from; that state."""
    if command == "revert":
        assert tree.cli("apply") == 0
        assert tree.snapshot() == STATES.overlay
    return tree.snapshot()


def _end(command: str) -> Snapshot:
    return STATES.overlay if command == "apply" else STATES.base


def _assert_whole_files(tree: FakeTree, before: Snapshot, after: Snapshot) -> None:
    """Each pinned file and the manifest is whole: its bytes before or after."""
    now = tree.snapshot()
    for name in set(before) | set(after):
        if name.startswith(".") and name != ".overlay-manifest.json":
            continue
        assert now.get(name) in (before.get(name), after.get(name)), name


def _status_args(tree: FakeTree) -> tuple[Target, Pin, Series]:
    checkout = Checkout(tree.repo)
    return detect_target(tree.vllm), checkout.pin, checkout.series


def _assert_clean(tree: FakeTree) -> None:
    report, _ = tree_status(*_status_args(tree))
    assert report.clean, report.notes


@pytest.mark.parametrize(("command", "point"), KILL_POINTS)
def test_kill_at_every_step_is_recovered_by_one_command(
    tmp_path: Path, command: str, point: int
) -> None:
    tree = FakeTree.create(tmp_path / "t")
    before = _start(tree, command)
    run = tree.kill_at(command, point)
    assert run.returncode == -9, run.stderr
    _assert_whole_files(tree, before, _end(command))
    if (tree.module / JOURNAL_NAME).exists():
        report, _ = tree_status(*_status_args(tree))
        assert any("interrupted" in n for n in report.notes)
        assert tree.cli("status") == 1
    # One command alone reaches either end from the same killed state.
    for recover, expected in (("apply", STATES.overlay), ("revert", STATES.base)):
        copy = tree.copy(tmp_path / recover)
        assert copy.cli(recover) == 0
        assert copy.snapshot() == expected
        _assert_clean(copy)


# A state with a journal and every file already renamed: the kill came just
# before the commit point (removing the journal).
BEFORE_COMMIT = STATES.apply_steps.index("remove journal") + 1


def _killed_before_commit(root: Path) -> FakeTree:
    tree = FakeTree.create(root)
    run = tree.kill_at("apply", BEFORE_COMMIT)
    assert run.returncode == -9
    assert (tree.module / JOURNAL_NAME).exists()
    return tree


def _recovery_steps() -> dict[str, int]:
    counts = {}
    for command in ("apply", "revert"):
        root = Path(tempfile.mkdtemp(prefix="vllm-overlay-faults-"))
        counts[command] = len(recorded_steps(_killed_before_commit(root), command))
        shutil.rmtree(root)
    return counts


RECOVERY_STEPS = _recovery_steps()
RECOVERY_POINTS = [
    (command, n) for command, count in RECOVERY_STEPS.items() for n in range(1, count)
]


@pytest.mark.parametrize(("command", "point"), RECOVERY_POINTS)
def test_kill_during_recovery_is_recovered_by_the_next(
    tmp_path: Path, command: str, point: int
) -> None:
    tree = _killed_before_commit(tmp_path / "t")
    run = tree.kill_at(command, point)
    assert run.returncode == -9, run.stderr
    assert tree.cli(command) == 0
    assert tree.snapshot() == _end(command)
    _assert_clean(tree)


@pytest.mark.parametrize(("command", "point"), KILL_POINTS)
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_signal_at_every_step_rolls_back_or_completes(
    tmp_path: Path, command: str, point: int, signal_name: str
) -> None:
    """Before the commit point the write is undone (one line, status 2);
    after it the write completes. Either way nothing is left over."""
    tree = FakeTree.create(tmp_path / "t")
    before = _start(tree, command)
    run = tree.kill_at(command, point, signal_name)
    after = tree.snapshot()
    if run.returncode == 2:
        assert after == before
        assert run.stderr.count("\n") == 1
        assert f"interrupted by {signal_name}" in run.stderr
        assert "Traceback" not in run.stderr
    else:
        assert run.returncode == 0, run.stderr
        assert after == _end(command)


@pytest.mark.parametrize(("command", "point"), KILL_POINTS)
def test_io_error_at_every_step_rolls_back(
    tmp_path: Path, command: str, point: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC (as a full disk gives) at any step before the commit point:
    every file restored, modes included, no temporary left; after it: done."""
    tree = FakeTree.create(tmp_path / "t")
    before = _start(tree, command)
    seen = {"n": 0}

    def full(step: str) -> None:
        seen["n"] += 1
        if seen["n"] == point:
            raise OSError(errno.ENOSPC, "No space left on device", step)

    monkeypatch.setattr(transaction, "_fault_hook", full)
    target, pin, series = _status_args(tree)
    run = apply_series if command == "apply" else revert_series
    try:
        run(target, pin, series)
    except ApplyError as e:
        assert "No space left on device" in str(e)
        assert "restored" in str(e)
        assert tree.snapshot() == before
    else:
        # Past the commit point: done; at most a backup is left, which the
        # next command removes.
        done = tree.snapshot()
        assert {k: v for k, v in done.items() if not k.endswith(".overlay-old")} == (
            _end(command)
        )
        monkeypatch.setattr(transaction, "_fault_hook", None)
        assert tree.cli(command) == 0
        assert tree.snapshot() == _end(command)


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _paused(tree: FakeTree, tmp_path: Path, command: str) -> subprocess.Popen[str]:
    """``command`` in a child caught mid-commit (the journal written), with
    the lock held; release it by creating tmp_path/go."""
    ready = tmp_path / "ready"
    args = [PAUSE_DRIVER, "rename journal", str(ready), str(tmp_path / "go")]
    proc = _spawn(["-c", *args, *tree.argv(command)])
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return proc


@pytest.mark.parametrize("second", ["apply", "revert"])
def test_second_writer_is_refused_with_the_first_ones_pid(
    tmp_path: Path, second: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = FakeTree.create(tmp_path / "t")
    first = _paused(tree, tmp_path, "apply")
    during = tree.snapshot()
    capsys.readouterr()
    assert tree.cli(second) == 2
    err = capsys.readouterr().err
    assert err == f"error: another apply is running (pid {first.pid}) on " + (
        f"{tree.module}; try again when it is done\n"
    )
    assert tree.snapshot() == during  # the second one changed nothing
    report, _ = tree_status(*_status_args(tree))
    assert f"an apply is running (pid {first.pid})" in report.notes
    (tmp_path / "go").touch()
    assert first.wait(timeout=120) == 0
    assert tree.snapshot() == STATES.overlay
    assert not (tree.module / LOCK_NAME).exists()


def test_wait_runs_after_the_first_writer(tmp_path: Path) -> None:
    tree = FakeTree.create(tmp_path / "t")
    first = _paused(tree, tmp_path, "apply")
    second = _spawn(["-m", "vllm_overlay.cli", *tree.argv("revert", "--wait")])
    time.sleep(0.5)
    assert second.poll() is None  # waiting for the lock
    (tmp_path / "go").touch()
    assert first.wait(timeout=120) == 0
    assert second.wait(timeout=120) == 0, second.communicate()
    assert tree.snapshot() == STATES.base


@pytest.mark.parametrize("pair", [("apply", "apply"), ("apply", "revert")])
def test_racing_writers_leave_one_whole_state(
    tmp_path: Path, pair: tuple[str, str]
) -> None:
    """Started together, with no pause: each one completes or is refused
    with the lock message, and the tree is exactly one state."""
    for attempt in range(3):
        tree = FakeTree.create(tmp_path / str(attempt))
        procs = [_spawn(["-m", "vllm_overlay.cli", *tree.argv(c)]) for c in pair]
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0 or "another apply is running" in err, err
        assert tree.snapshot() in (STATES.base, STATES.overlay)
        _assert_clean(tree)
