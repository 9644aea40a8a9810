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

Nothing is written through a symlink: each temporary, backup and journal
file is created exclusively (``O_EXCL|O_NOFOLLOW``), each file is checked
to be the one this commit wrote (or found) before it is renamed or backed
up and after, and a symlink or any non-regular file standing at one of
these paths, or at a file to replace, is refused with one line naming it
(what a commit cut short had changed is undone first).

``Lock`` serialises writers of one directory with ``flock`` on a lock file
holding the writer's pid; the file is removed when the lock is released. It
is opened without following a symlink and must be a regular file with no
other hard link.

``_fault_hook`` is for the tests only: it is called with the name of every
step before the step runs (the fault-injection suite kills the process
there, or raises).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.safefile import (
    MAX_READ_BYTES,
    NotRegularError,
    UnsafeFileError,
    create_exclusive,
    describe_stat,
    is_regular,
    lstat,
    open_regular,
    read_regular,
    same_file,
    standing,
    write_all,
)
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


class Planted(TransactionError):
    """Something this commit did not write stands where one of its files
    goes (a symlink, above all): it is refused, never written through."""


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


def _write_file(path: Path, data: bytes, mode: int, step: str) -> os.stat_result:
    """A new file at ``path`` (created exclusively: nothing standing there
    is written through); its status, to recognise it later."""
    _step(f"write {step}")
    fd = _create(path)
    try:
        write_all(fd, data)
        os.fchmod(fd, mode)
        _step(f"fsync {step}")
        os.fsync(fd)
        return os.fstat(fd)
    finally:
        os.close(fd)


def _create(path: Path) -> int:
    try:
        return create_exclusive(path)
    except UnsafeFileError as e:
        raise Planted(f"{e}; refusing to write through it") from None


def _regular_or_absent(path: Path, then: str = "") -> os.stat_result | None:
    """``path``'s status when it is a regular file, None when absent; a
    symlink or anything else there is ``Planted``."""
    st = lstat(path)
    if st is not None and not is_regular(st):
        why = f"{describe_stat(path, st)}, not a regular file"
        raise Planted(f"{path}: {why}{then}")
    return st


def _expect(path: Path, seen: os.stat_result | None, what: str) -> None:
    """``path`` is still the file this commit wrote or found (``seen``)."""
    now = lstat(path)
    if not same_file(now, seen):
        was = "gone" if now is None else f"now {describe_stat(path, now)}"
        raise Planted(f"{path}: {what} was replaced during the write ({was})")


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
        if lstat(self.journal) is not None:
            raise TransactionError(
                f"{self.journal}: an earlier write was interrupted; recover first"
            )
        entries = []
        found: dict[str, os.stat_result] = {}
        for rel, change in sorted(changes.items()):
            path = self._resolve(rel)
            st = lstat(path)
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise TransactionError(f"{path}: is a directory, not a file")
            if st is not None and not is_regular(st):
                raise Planted(
                    f"{path}: {describe_stat(path, st)}, not a regular file; "
                    "nothing was written"
                )
            existed = st is not None
            mode = change.mode
            if mode is None:
                mode = st.st_mode & 0o7777 if st is not None else 0o644
            if change.data is None and not existed:
                continue
            if st is not None:
                found[rel] = st
            entries.append(JournalEntry(rel, existed, change.data is None, mode))
        if not entries:
            return
        self._clear_own_names(entries)
        data = {rel: change.data for rel, change in changes.items()}
        journal = Journal(os.getpid(), entries)
        with _signals_raise():
            try:
                self._run(journal, data, found)
            except (OSError, Interrupted, Planted) as e:
                self.undo()
                _remove_regular(self.root / _JOURNAL_TMP)
                if isinstance(e, TransactionError):
                    if isinstance(e, Planted):
                        raise Planted(
                            f"{e}; every file was restored, the target is unchanged"
                        ) from None
                    raise
                where = e.filename or self.root
                raise TransactionError(
                    f"writing {where} failed ({e.strerror or e}); every file was "
                    "restored, the target is unchanged"
                ) from None
            self._clean_up(journal)

    def _clear_own_names(self, entries: list[JournalEntry]) -> None:
        """Before anything is written: a stale temporary or backup file of
        an earlier commit goes; anything but a regular file there is refused."""
        names = [self.root / _JOURNAL_TMP]
        for e in entries:
            path = self._resolve(e.path)
            names += [temp_name(path), backup_name(path)]
        for name in names:
            _regular_or_absent(name, "; nothing was written")
        for name in names:
            name.unlink(missing_ok=True)

    def _run(
        self,
        journal: Journal,
        data: Mapping[str, bytes | None],
        found: Mapping[str, os.stat_result],
    ) -> None:
        tmp = self.root / _JOURNAL_TMP
        written = _write_file(tmp, msgspec.json.encode(journal), 0o644, "journal")
        _step("rename journal")
        _expect(tmp, written, "the journal")
        os.replace(tmp, self.journal)
        _expect(self.journal, written, "the journal")
        self._sync("journal")
        dirs = {self._resolve(e.path).parent for e in journal.entries}
        ours: dict[str, os.stat_result] = {}
        for e in journal.entries:
            content = data[e.path]
            if content is not None:
                path = self._resolve(e.path)
                ours[e.path] = _write_file(temp_name(path), content, e.mode, e.path)
        backups: dict[str, os.stat_result] = {}
        for e in journal.entries:
            if e.existed:
                _step(f"backup {e.path}")
                backups[e.path] = _backup(self._resolve(e.path), found[e.path])
        self._sync("backups", dirs)
        for e in journal.entries:
            path = self._resolve(e.path)
            _check_signals()
            if e.existed:
                _expect(backup_name(path), backups[e.path], "the backup")
            if e.delete:
                _step(f"remove {e.path}")
                os.unlink(path)
            else:
                _step(f"rename {e.path}")
                temp = temp_name(path)
                _expect(temp, ours[e.path], "the new file")
                os.replace(temp, path)
                _expect(path, ours[e.path], "the new file")
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
            raw = read_regular(self.journal, MAX_READ_BYTES, "a journal")
        except FileNotFoundError:
            return None
        except UnsafeFileError as e:
            raise TransactionError(
                f"{e}: not reading it as the journal; remove it by hand after "
                "checking `vllm-overlay status`"
            ) from None
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
        """Undo an interrupted commit, if any; True when one was undone. A
        backup that is not a regular file is left alone, never restored."""
        journal = self.read_journal()
        if journal is None:
            return False
        with _signals_deferred():
            dirs = set()
            for e in journal.entries:
                path = self._resolve(e.path)
                dirs.add(path.parent)
                backup = backup_name(path)
                kept = lstat(backup)
                if kept is not None and not is_regular(kept):
                    # Not ours (`recover` refuses it): a commit checks each
                    # backup right before it touches the file, so a file
                    # whose backup was replaced is untouched.
                    pass
                elif kept is not None:
                    _step(f"undo {e.path}")
                    if same_file(lstat(path), kept):
                        os.unlink(backup)
                    else:
                        os.replace(backup, path)
                elif not e.existed and lstat(path) is not None:
                    _step(f"undo {e.path}")
                    os.unlink(path)
                _remove_regular(temp_name(path))
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

    def planted(self) -> list[str]:
        """What stands at one of this transaction's own paths (journal,
        lock, temporary and backup files) and is not a regular file: one line
        each."""
        out = []
        for path in (self.journal, self.root / LOCK_NAME, *self.leftovers()):
            st = lstat(path)
            if st is not None and not is_regular(st):
                out.append(f"{path}: {describe_stat(path, st)}, not a regular file")
        return out

    def recover(self) -> list[str]:
        """Undo an interrupted commit and remove leftovers; what was done. A
        symlink (or any non-regular file) at one of the transaction's own
        paths is refused before anything is done: it is no leftover of ours."""
        planted = self.planted()
        if planted:
            more = f" (and {len(planted) - 1} more)" if len(planted) > 1 else ""
            raise Planted(
                f"{planted[0]}{more}: it is not the overlay's; nothing was written "
                "(remove it by hand)"
            )
        done = []
        if self.undo():
            done.append("undid an interrupted write")
        stray = self.leftovers()
        for path in stray:
            _step(f"remove leftover {path.name}")
            _remove_regular(path)
        for d in sorted({p.parent for p in stray}):
            fsync_dir(d)
        if stray:
            done.append(f"removed {count(len(stray), 'leftover file')}")
        return done


def _remove_regular(path: Path) -> None:
    """Remove ``path`` if it is a regular file: anything else there is not
    ours, and is left for `recover` to refuse."""
    if is_regular(lstat(path)):
        path.unlink(missing_ok=True)


def _backup(path: Path, found: os.stat_result) -> os.stat_result:
    """A hard link ``.NAME.overlay-old`` to ``path`` (a copy where links are
    not supported), after checking ``path`` is still the file ``found``;
    the backup's status."""
    backup = backup_name(path)
    _expect(path, found, "the file to replace")
    try:
        os.link(path, backup, follow_symlinks=False)
    except FileExistsError:
        raise Planted(f"{standing(backup)}; refusing to write through it") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK):
            raise
        return _copy(path, found, backup)
    _expect(backup, found, "the backup")
    return found


def _copy(path: Path, found: os.stat_result, backup: Path) -> os.stat_result:
    src, st = open_regular(path)
    try:
        if not same_file(st, found):
            raise Planted(f"{path}: the file to replace was replaced during the write")
        dst = _create(backup)
        try:
            while chunk := os.read(src, 1 << 20):
                write_all(dst, chunk)
            os.fchmod(dst, st.st_mode & 0o7777)
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
            os.fsync(dst)
            return os.fstat(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)


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
    holder is an error naming its pid. The lock file is never opened through
    a symlink, and must be a regular file with no other hard link (one
    linked to a file elsewhere would be truncated)."""
    path = directory / LOCK_NAME
    while True:
        fd = _open_lock(path)
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
        if same_file(os.fstat(fd), lstat(path)):
            break
        os.close(fd)
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            raise TransactionError(
                f"cannot write this process's pid into the lock {path}: "
                f"{e.strerror or e}; nothing was written"
            ) from None
        yield
    finally:
        with contextlib.suppress(OSError):
            if same_file(os.fstat(fd), lstat(path)):
                os.unlink(path)
        os.close(fd)


def _open_lock(path: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        st = lstat(path) if e.errno == errno.ELOOP else None
        if st is not None:
            raise Planted(
                f"{path}: {describe_stat(path, st)}, not a regular file; not "
                "using it as the lock, nothing was written (remove it by hand)"
            ) from None
        raise TransactionError(f"cannot create the lock {path}: {e.strerror}") from None
    st = os.fstat(fd)
    problem = ""
    if not is_regular(st):
        problem = f"{describe_stat(path, st)}, not a regular file"
    elif st.st_nlink != 1:
        problem = f"a file with {st.st_nlink - 1} other hard link(s)"
    if problem:
        os.close(fd)
        raise Planted(
            f"{path}: {problem}; not using it as the lock, nothing was written "
            "(remove it by hand)"
        )
    return fd


def _read_pid(fd: int) -> str:
    for _ in range(20):  # the holder writes its pid right after locking
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.01)
    return ""


def lock_holder(directory: Path) -> str | None:
    """The pid holding ``directory``'s lock ('' if unknown); None when free
    (or when no regular file stands at the lock's path)."""
    try:
        fd, _ = open_regular(directory / LOCK_NAME)
    except (OSError, NotRegularError):
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
