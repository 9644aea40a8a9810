"""Files the overlay reads from or writes into a target without following a
symlink planted at their path.

A target (site-packages, a vLLM checkout, a `materialize` directory) may be
writable by others than the user running the overlay, often as root. So
every file the overlay creates there is created exclusively
(``O_EXCL|O_NOFOLLOW``: a symlink or any file already at the path is an
error, never written through), every file it reads whole is opened with
``O_NOFOLLOW`` and checked to be a regular file of bounded size before it is
read, and anything else standing at one of those paths is refused with one
line naming it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from vllm_overlay.errors import OverlayError

# The largest file read whole into memory from a target: a pinned file, the
# manifest or the journal (the largest pinned file is about 200 kB).
MAX_READ_BYTES = 4 << 20

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = os.O_NOFOLLOW


class UnsafeFileError(OverlayError):
    """Something other than the regular file the overlay expects stands at a
    path (a symlink, a directory, a FIFO...), or the file is too large."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


class NotRegularError(UnsafeFileError):
    """A symlink or anything but a regular file stands at the path."""

    def __init__(self, path: Path, st: os.stat_result, why: str = ""):
        super().__init__(path, why or f"{describe_stat(path, st)}, not a regular file")
        self.st = st


class TooLargeError(UnsafeFileError):
    """The file is larger than the cap on what is read into memory."""

    def __init__(self, path: Path, size: int, cap: int, what: str):
        super().__init__(
            path, f"{size} bytes, larger than the {cap}-byte cap on {what}"
        )
        self.size = size
        self.cap = cap


def describe_stat(path: Path, st: os.stat_result) -> str:
    """``a symlink to X``, ``a directory``, ``a FIFO``...: what stands at
    ``path`` (whose ``lstat`` is ``st``)."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        try:
            return f"a symlink to {os.readlink(path)}"
        except OSError:
            return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device file"


def lstat(path: Path) -> os.stat_result | None:
    """``path``'s own status (a symlink is not followed); None when absent."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def lstat_at(path: Path, dir_fd: int) -> os.stat_result | None:
    """``lstat`` of ``path`` relative to the directory ``dir_fd``."""
    try:
        return os.lstat(path, dir_fd=dir_fd)
    except FileNotFoundError:
        return None


def is_regular(st: os.stat_result | None) -> bool:
    return st is not None and stat.S_ISREG(st.st_mode)


def same_file(a: os.stat_result | None, b: os.stat_result | None) -> bool:
    """The same file, unchanged: an inode number freed by an unlink is soon
    reused (by a symlink planted there, say), so its type, size and mtime
    must match too."""
    return (
        a is not None
        and b is not None
        and os.path.samestat(a, b)
        and stat.S_IFMT(a.st_mode) == stat.S_IFMT(b.st_mode)
        and (a.st_size, a.st_mtime_ns) == (b.st_size, b.st_mtime_ns)
    )


def create_exclusive(
    path: Path, mode: int = 0o600, *, dir_fd: int | None = None
) -> int:
    """A new file at ``path``, open for writing: whatever already stands
    there (a symlink above all) is a ``NotRegularError`` or, for a regular
    file, an ``UnsafeFileError``, and is left as it is."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    try:
        return os.open(path, flags, mode, dir_fd=dir_fd)
    except FileExistsError:
        raise standing(path, dir_fd) from None


def standing(path: Path, dir_fd: int | None = None) -> UnsafeFileError:
    """The error naming what stands at ``path``, which was to be created."""
    try:
        st = os.lstat(path, dir_fd=dir_fd)
    except OSError:
        return UnsafeFileError(path, "appeared while it was being created")
    if stat.S_ISREG(st.st_mode):
        return UnsafeFileError(
            path, "a file this write did not create stands there; it was left as it is"
        )
    return NotRegularError(path, st)


def open_regular(path: Path, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """``path`` opened without following a symlink, and its status; a
    symlink or anything but a regular file is a ``NotRegularError`` (a FIFO
    does not block the open). ``FileNotFoundError`` when absent."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        st = os.lstat(path)
        raise NotRegularError(path, st) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularError(path, st)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular(path: Path, cap: int = MAX_READ_BYTES, what: str = "a file") -> bytes:
    """The bytes of the regular file at ``path`` (not through a symlink),
    its size checked against ``cap`` before anything is read."""
    fd, st = open_regular(path)
    try:
        if st.st_size > cap:
            raise TooLargeError(path, st.st_size, cap, what)
        chunks = []
        size = 0
        while chunk := os.read(fd, min(1 << 20, cap + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:  # it grew since the fstat
                raise TooLargeError(path, size, cap, what)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def replace_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """``data`` at ``path``, written to a new file beside it and renamed over
    whatever stood there: a symlink at ``path`` is replaced, never written
    through, and a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = create_exclusive(tmp, mode)
    try:
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
