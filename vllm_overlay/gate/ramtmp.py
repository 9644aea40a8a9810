"""Where the gate's steps keep their temporary files: in memory, when there is
room.

The suite creates and removes tens of thousands of files and directories
(pytest's ``tmp_path``, the git repositories of the export and the rebase
tests, the simulator's run directories). On an ext4 disk mounted with
``discard``, as this project's CI machines are, every removal is a TRIM and
every new directory an inode-bitmap search, all of it system time: the
export check alone takes 27 s there and 15 s on a tmpfs. The gate makes one
directory on the first tmpfs of ``CANDIDATES`` with ``MIN_FREE`` bytes free,
hands it to every step as ``TMPDIR`` and removes it when it ends; without
one, or with ``TMPDIR`` set by the caller (a place chosen on purpose), it
stays as it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

CANDIDATES = (Path("/dev/shm"),)
MIN_FREE = 4 << 30
PREFIX = "vllm-overlay-gate-"
MOUNTS = Path("/proc/self/mounts")


def tmpfs_mounts(mounts: Path = MOUNTS) -> set[Path]:
    """The mount points of tmpfs file systems."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return set()
    found = set()
    for line in lines:
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "tmpfs":
            found.add(Path(fields[1].replace("\\040", " ")))
    return found


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def ram_dir(
    candidates: Sequence[Path] = CANDIDATES,
    mounts: Path = MOUNTS,
    min_free: int = MIN_FREE,
) -> tuple[Path | None, str]:
    """The first candidate that is a writable tmpfs mount point with room,
    and why (one line, for the log)."""
    tmpfs = tmpfs_mounts(mounts)
    for path in candidates:
        if path not in tmpfs:
            continue
        if not os.access(path, os.W_OK | os.X_OK):
            continue
        try:
            free = free_bytes(path)
        except OSError:
            continue
        if free >= min_free:
            return path, f"tmpfs, {free / 2**30:.1f} GiB free"
    wanted = ", ".join(str(p) for p in candidates)
    return None, f"no tmpfs with {min_free / 2**30:.0f} GiB free at {wanted}"


@contextmanager
def run_tmpdir(
    environ: Mapping[str, str],
    candidates: Sequence[Path] = CANDIDATES,
    mounts: Path = MOUNTS,
    min_free: int = MIN_FREE,
) -> Iterator[tuple[Path | None, str]]:
    """A directory of its own on a tmpfs with room for the block (removed
    after it, whatever happens), or None; with the log line."""
    if environ.get("TMPDIR"):
        yield None, "$TMPDIR set by the caller"
        return
    where, why = ram_dir(candidates, mounts, min_free)
    if where is None:
        yield None, why
        return
    made = Path(tempfile.mkdtemp(prefix=PREFIX, dir=where))
    try:
        yield made, why
    finally:
        shutil.rmtree(made, ignore_errors=True)
