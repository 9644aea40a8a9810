"""The pinned base files, from the pinned wheel or a vLLM tree, and the base
or overlaid MoRIIO files written out of them.

Every command that needs the base files gets them one way: ``--wheel WHEEL``
(the pinned wheel, checked by its sha256) or ``--from DIR`` (a vLLM tree
holding the base or a known overlay, peeled back to the base); without
either, ``$VLLM_OVERLAY_WHEEL``, else this Python's vLLM.
"""

from __future__ import annotations

import contextlib
import os
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.safefile import (
    MAX_READ_BYTES,
    UnsafeFileError,
    create_exclusive,
    describe_stat,
    is_regular,
    lstat_at,
    write_all,
)
from vllm_overlay.series.patch_series import Series
from vllm_overlay.series.pin import Pin, sha256_bytes, sha256_file
from vllm_overlay.tree.apply import overlay_texts
from vllm_overlay.tree.status import tree_status
from vllm_overlay.tree.target import Target, detect_target, installed_vllm

WHEEL_ENV = "VLLM_OVERLAY_WHEEL"


class MaterializeError(OverlayError):
    """The base files cannot be obtained."""


def base_from_target(target: Target, pin: Pin, series: Series) -> dict[str, str]:
    """The pinned base texts, from a tree that is the base or a known overlay."""
    report, bases = tree_status(target, pin, series)
    missing = [f for f in report.files if f.path in pin.files and f.path not in bases]
    if missing:
        f = missing[0]
        raise MaterializeError(
            f"{f.path} in {target.describe()} is {f.state}: cannot recover the "
            f"pinned base (expected sha256 {f.expected_sha256}, actual "
            f"{f.actual_sha256 or '-'})"
        )
    return bases


def base_from_wheel(
    wheel: Path, pin: Pin, files: dict[str, str] | None = None
) -> dict[str, str]:
    """The pinned base texts, from the pinned wheel (checked by its sha256):
    the MoRIIO files, or the ``files`` given (path -> sha256)."""
    try:
        actual = sha256_file(wheel)
    except OSError as e:
        raise MaterializeError(
            f"{wheel}: cannot read the wheel: {e.strerror}"
        ) from None
    if actual != pin.vllm.wheel_sha256:
        raise MaterializeError(
            f"{wheel}: sha256 {actual} is not the pinned wheel's "
            f"{pin.vllm.wheel_sha256}"
        )
    out: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as zf:
        for path, sha in (pin.files if files is None else files).items():
            try:
                size = zf.getinfo(path).file_size
            except KeyError:
                raise MaterializeError(f"{wheel}: holds no {path}") from None
            if size > MAX_READ_BYTES:
                raise MaterializeError(
                    f"{wheel}!{path}: {size} bytes, larger than the "
                    f"{MAX_READ_BYTES}-byte cap on a pinned file"
                )
            data = zf.read(path)
            if sha256_bytes(data) != sha:
                raise MaterializeError(f"{wheel}!{path}: does not match the pin")
            out[path] = data.decode()
    return out


@dataclass(frozen=True)
class Bases:
    texts: dict[str, str]  # pinned path -> base text
    source: str  # where they came from, for people


@dataclass(frozen=True)
class BaseSource:
    """Where the base files come from: at most one of ``wheel`` and ``tree``."""

    wheel: Path | None = None
    tree: Path | None = None

    def resolved(self) -> BaseSource:
        """The source to use: the one given, else ``$VLLM_OVERLAY_WHEEL``,
        else this Python's vLLM."""
        if self.wheel is not None or self.tree is not None:
            return self
        if os.environ.get(WHEEL_ENV):
            return BaseSource(wheel=Path(os.environ[WHEEL_ENV]))
        return BaseSource(tree=installed_vllm())

    def load(self, pin: Pin, series: Series) -> Bases:
        source = self.resolved()
        if source.wheel is not None:
            return Bases(
                base_from_wheel(source.wheel, pin), f"wheel {source.wheel.name}"
            )
        assert source.tree is not None
        target = detect_target(source.tree)
        return Bases(base_from_target(target, pin, series), target.describe())

    def load_core(self, pin: Pin) -> dict[str, str]:
        """The pinned base texts of the core files (``pin.core_files``)."""
        source = self.resolved()
        if source.wheel is not None:
            return base_from_wheel(source.wheel, pin, pin.core_files)
        assert source.tree is not None
        return core_from_target(detect_target(source.tree), pin)


def core_from_target(target: Target, pin: Pin) -> dict[str, str]:
    """The pinned core files (``pin.core_files``) of a vLLM tree, checked by
    their sha256 (no core patch is ever applied to a tree)."""
    out: dict[str, str] = {}
    for path, sha in pin.core_files.items():
        file = target.file(path)
        try:
            data = file.read_bytes()
        except OSError as e:
            raise MaterializeError(f"{file}: cannot read: {e.strerror}") from None
        if sha256_bytes(data) != sha:
            raise MaterializeError(
                f"{file}: sha256 {sha256_bytes(data)} is not the pinned {sha}"
            )
        out[path] = data.decode()
    return out


def core_texts(core_bases: dict[str, str], core: Series) -> dict[str, str]:
    """The core files with the core patches ``core`` holds applied."""
    return {**core_bases, **overlay_texts(core_bases, core)}


def materialize(
    bases: dict[str, str], series: Series, out: Path, *, overlay: bool = True
) -> list[Path]:
    """Write every pinned file below ``out``, path-preserving; with
    ``overlay`` the series is applied first. Returns the files written.

    Below ``out`` nothing is written through a symlink: each directory is
    opened without following one, each file is written to a new file
    created exclusively and renamed into place, and a symlink (or anything
    but a directory or a regular file) standing at one of these paths is
    refused before anything is written."""
    texts = dict(bases)
    if overlay:
        texts.update(overlay_texts(bases, series))
    try:
        out.mkdir(parents=True, exist_ok=True)
        root = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        where = e.filename or out
        raise MaterializeError(
            f"--out {out}: cannot write {where}: {e.strerror}"
        ) from None
    try:
        for path in sorted(texts):
            _check_below(root, out, path)
        written = []
        for path, text in sorted(texts.items()):
            _write_below(root, out, path, text.encode())
            written.append(out / path)
    finally:
        os.close(root)
    return written


def _check_below(root: int, out: Path, path: str) -> None:
    """Refuse a symlink (or anything unexpected) on ``path``'s way below
    ``out``, at ``path`` or at its temporary file, before anything is
    written."""
    parts = path.split("/")
    temp = "/".join([*parts[:-1], f".{parts[-1]}.overlay-new"])
    ways = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for rel in [*ways, temp]:
        try:
            st = os.lstat(rel, dir_fd=root)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise MaterializeError(
                f"--out {out}: cannot write {out / rel}: {e.strerror}"
            ) from None
        is_dir = rel not in (path, temp)
        if not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
            raise MaterializeError(
                f"--out {out}: {out / rel} is {describe_stat(out / rel, st)}, not "
                f"{'a directory' if is_dir else 'a regular file'}; nothing was "
                "written"
            )


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_below(root: int, out: Path, path: str, data: bytes) -> None:
    """``data`` into ``out/path``: each directory opened without following
    a symlink, a new file created exclusively, renamed over the old one."""
    *dirs, name = path.split("/")
    fd = os.dup(root)
    try:
        for part in dirs:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=fd)
            sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
        temp = Path(f".{name}.overlay-new")
        if is_regular(lstat_at(temp, fd)):  # left by a run cut short
            os.unlink(temp, dir_fd=fd)
        new = create_exclusive(temp, 0o666, dir_fd=fd)
        try:
            write_all(new, data)
        finally:
            os.close(new)
        os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except UnsafeFileError as e:
        raise MaterializeError(f"--out {out}: {out / path}: {e.why}") from None
    except OSError as e:
        raise MaterializeError(
            f"--out {out}: cannot write {out / path}: {e.strerror}"
        ) from None
    finally:
        os.close(fd)
