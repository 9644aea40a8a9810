"""Change several files at once, all or nothing, even across a kill.

A ``commit`` writes an undo journal before it touches anything, and removes
it as its last step, after every file is in place: removing the journal is
the commit point. The steps, in order:

1. the journal ``.overlay-journal.json`` (written aside, fsynced, renamed
   into place, the directory fsynced): every file to change, whether it
   existed, the names of its temporary and backup files;
2. each new content into ``.NAME.overlay-new`` next to its file, with the
   file's mode, fsynced;
3. a hard link ``.NAME.overlay-old`` to each file about to be replaced or
   removed (a copy where links are not supported): the original bytes and
   mode stay on disk;
4. each new file renamed over its target (or the target removed);
5. the journal removed (the commit point), then the backups.

The directories are fsynced after steps 1, 3, 4 and 5. ``recover`` undoes a
commit that has a journal (each backup renamed back, each file the commit
created removed) and removes every leftover temporary or backup; it is
idempotent, so a kill during recovery is recovered by the next one. A
failure or SIGINT/SIGTERM inside ``commit`` runs the same undo before the
error is raised: the files are as they were, modes included (a signal past
the commit point is ignored: the commit is complete).

``Lock`` serialises writers of one directory with ``flock`` on a lock file
holding the writer's pid; the file is removed when the lock is released.

``_fault_hook`` is for the tests only: it is called with the name of every
step before the step runs (the fault-injection suite kills the process
there, or raises).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.text import count

JOURNAL_NAME = ".overlay-journal.json"
LOCK_NAME = ".overlay-lock"
_NEW = ".overlay-new"
_OLD = ".overlay-old"
_JOURNAL_TMP = JOURNAL_NAME + ".tmp"

# Tests only: called with each step's name before the step runs.
_fault_hook: Callable[[str], None] | None = None


class TransactionError(OverlayError):
    """A multi-file write failed (and was undone), or cannot start."""


class Interrupted(TransactionError):
    """SIGINT or SIGTERM arrived during a commit (which was undone)."""


class JournalEntry(msgspec.Struct, forbid_unknown_fields=True):
    path: str  # relative to the transaction's root
    existed: bool
    delete: bool
    mode: int


class Journal(msgspec.Struct, forbid_unknown_fields=True):
    pid: int
    entries: list[JournalEntry]


def _step(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


def temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{_NEW}")


def backup_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{_OLD}")


def is_leftover(path: Path) -> bool:
    """A file only a commit cut short leaves behind."""
    name = path.name
    return name.startswith(".") and (
        name.endswith((_NEW, _OLD)) or name == _JOURNAL_TMP
    )


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes, mode: int, step: str) -> None:
    _step(f"write {step}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
        _step(f"fsync {step}")
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Change:
    data: bytes | None  # None: remove the file
    mode: int | None = None  # None: keep the file's mode (0o644 for a new file)


class Transaction:
    """Files below ``root`` changed together; the journal lives in ``root``.
    ``dirs``: where leftovers may stand (default: ``root``)."""

    def __init__(self, root: Path, dirs: Iterable[Path] = ()):
        self.root = root
        self.journal = root / JOURNAL_NAME
        self.dirs = sorted({root, *dirs})

    def _resolve(self, rel: str) -> Path:
        path = self.root / rel
        real_root = self.root.resolve()
        real = path.parent.resolve() / path.name
        if real_root not in real.parents:
            raise TransactionError(f"{rel}: resolves outside {self.root}")
        return path

    # -- commit --------------------------------------------------------------

    def commit(self, changes: Mapping[str, Change]) -> None:
        """Apply ``changes`` (path relative to ``root`` -> new content) all
        at once; on any failure or SIGINT/SIGTERM, undo and raise."""
        if self.journal.exists():
            raise TransactionError(
                f"{self.journal}: an earlier write was interrupted; recover first"
            )
        entries = []
        for rel, change in sorted(changes.items()):
            path = self._resolve(rel)
            if path.is_dir() and not path.is_symlink():
                raise TransactionError(f"{path}: is a directory, not a file")
            existed = path.is_file()
            mode = change.mode
            if mode is None:
                mode = path.stat().st_mode & 0o7777 if existed else 0o644
            if change.data is None and not existed:
                continue
            entries.append(JournalEntry(rel, existed, change.data is None, mode))
        if not entries:
            return
        data = {rel: change.data for rel, change in changes.items()}
        journal = Journal(os.getpid(), entries)
        with _signals_raise():
            try:
                self._run(journal, data)
            except (OSError, Interrupted) as e:
                self.undo()
                (self.root / _JOURNAL_TMP).unlink(missing_ok=True)
                if isinstance(e, Interrupted):
                    raise
                where = e.filename or self.root
                raise TransactionError(
                    f"writing {where} failed ({e.strerror or e}); every file was "
                    "restored, the target is unchanged"
                ) from None
            self._clean_up(journal)

    def _run(self, journal: Journal, data: Mapping[str, bytes | None]) -> None:
        tmp = self.root / _JOURNAL_TMP
        _write_file(tmp, msgspec.json.encode(journal), 0o644, "journal")
        _step("rename journal")
        os.replace(tmp, self.journal)
        self._sync("journal")
        dirs = {self._resolve(e.path).parent for e in journal.entries}
        for e in journal.entries:
            content = data[e.path]
            if content is not None:
                path = self._resolve(e.path)
                _write_file(temp_name(path), content, e.mode, e.path)
        for e in journal.entries:
            if e.existed:
                _step(f"backup {e.path}")
                _backup(self._resolve(e.path))
        self._sync("backups", dirs)
        for e in journal.entries:
            path = self._resolve(e.path)
            _check_signals()
            if e.delete:
                _step(f"remove {e.path}")
                os.unlink(path)
            else:
                _step(f"rename {e.path}")
                os.replace(temp_name(path), path)
        self._sync("renames", dirs)
        _check_signals()
        # The commit point: from here on the new files stand.
        _step("remove journal")
        os.unlink(self.journal)

    def _clean_up(self, journal: Journal) -> None:
        """After the commit point: the backups go. Best effort, step by step:
        what a failure here leaves, the next ``recover`` removes."""
        dirs = {self._resolve(e.path).parent for e in journal.entries}
        with _signals_deferred():
            with contextlib.suppress(OSError):
                self._sync("commit")
            for e in journal.entries:
                if e.existed:
                    with contextlib.suppress(OSError):
                        _step(f"remove backup {e.path}")
                        backup_name(self._resolve(e.path)).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self._sync("cleanup", dirs)

    def _sync(self, what: str, dirs: set[Path] | None = None) -> None:
        for d in sorted(dirs or {self.root}):
            _step(f"fsync dir after {what}")
            fsync_dir(d)

    # -- recovery ------------------------------------------------------------

    def read_journal(self) -> Journal | None:
        """The journal of an interrupted commit; None when there is none.
        An unreadable journal is an error: nothing can be undone safely."""
        try:
            raw = self.journal.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TransactionError(
                f"{self.journal}: cannot read: {e.strerror}"
            ) from None
        try:
            return msgspec.json.decode(raw, type=Journal)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise TransactionError(
                f"{self.journal}: not a journal ({e}); it was written before the "
                "files were touched only if it is complete: remove it by hand "
                "after checking `vllm-overlay status`"
            ) from None

    def undo(self) -> bool:
        """Undo an interrupted commit, if any; True when one was undone."""
        journal = self.read_journal()
        if journal is None:
            return False
        with _signals_deferred():
            dirs = set()
            for e in journal.entries:
                path = self._resolve(e.path)
                dirs.add(path.parent)
                backup = backup_name(path)
                if backup.exists():
                    _step(f"undo {e.path}")
                    if path.exists() and os.path.samefile(path, backup):
                        os.unlink(backup)
                    else:
                        os.replace(backup, path)
                elif not e.existed and path.exists():
                    _step(f"undo {e.path}")
                    os.unlink(path)
                temp_name(path).unlink(missing_ok=True)
            self._sync("undo", dirs)
            _step("remove journal after undo")
            self.journal.unlink()
            self._sync("undo")
        return True

    def leftovers(self) -> list[Path]:
        """Temporary and backup files an interrupted commit left."""
        return sorted(
            p for d in self.dirs if d.is_dir() for p in d.glob(".*") if is_leftover(p)
        )

    def recover(self) -> list[str]:
        """Undo an interrupted commit and remove leftovers; what was done."""
        done = []
        if self.undo():
            done.append("undid an interrupted write")
        stray = self.leftovers()
        for path in stray:
            _step(f"remove leftover {path.name}")
            path.unlink(missing_ok=True)
        for d in sorted({p.parent for p in stray}):
            fsync_dir(d)
        if stray:
            done.append(f"removed {count(len(stray), 'leftover file')}")
        return done


def _backup(path: Path) -> None:
    backup = backup_name(path)
    backup.unlink(missing_ok=True)
    try:
        os.link(path, backup)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK):
            raise
        shutil.copy2(path, backup)
        fd = os.open(backup, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- signals -------------------------------------------------------------------

_pending: list[int] = []


def _record(signum: int, frame: FrameType | None) -> None:
    _pending.append(signum)


def _check_signals() -> None:
    if _pending:
        signum = _pending[0]
        raise Interrupted(
            f"interrupted by {signal.Signals(signum).name}; every file was restored"
        )


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT/SIGTERM are recorded and raised between steps (then undone).
    One that arrives past the commit point is dropped: the commit is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pending.clear()
    old = {s: signal.signal(s, _record) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _pending.clear()


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Past the commit point, and while undoing, a signal does not stop the
    work: it is only recorded."""
    saved = list(_pending)
    _pending.clear()
    try:
        yield
    finally:
        _pending[:0] = saved


# -- the lock ------------------------------------------------------------------


class Locked(TransactionError):
    """Another process holds the lock."""


@contextmanager
def lock(directory: Path, *, wait: bool = False, what: str = "apply") -> Iterator[None]:
    """Hold the writers' lock of ``directory``; without ``wait`` another
    holder is an error naming its pid."""
    path = directory / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise TransactionError(
                f"cannot create the lock {path}: {e.strerror}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise Locked(
                f"another {what} is running (pid {holder or 'unknown'}) on "
                f"{directory}; try again when it is done"
            ) from None
        # The lock file may have been removed (and re-created) by the holder
        # we waited for: hold the lock of the file that is there now.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _read_pid(fd: int) -> str:
    for _ in range(20):  # the holder writes its pid right after locking
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.01)
    return ""


def lock_holder(directory: Path) -> str | None:
    """The pid holding ``directory``'s lock ('' if unknown); None when free."""
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
