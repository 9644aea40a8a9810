"""The pinned base files, from the pinned wheel or a vLLM tree, and the base
or overlaid MoRIIO files written out of them.

Every command that needs the base files gets them one way: ``--wheel WHEEL``
(the pinned wheel, checked by its sha256) or ``--from DIR`` (a vLLM tree
holding the base or a known overlay, peeled back to the base); without
either, ``$VLLM_OVERLAY_WHEEL``, else this Python's vLLM.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import OverlayError
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


def base_from_wheel(wheel: Path, pin: Pin) -> dict[str, str]:
    """The pinned base texts, from the pinned wheel (checked by its sha256)."""
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
        for path, sha in pin.files.items():
            try:
                data = zf.read(path)
            except KeyError:
                raise MaterializeError(f"{wheel}: holds no {path}") from None
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


def materialize(
    bases: dict[str, str], series: Series, out: Path, *, overlay: bool = True
) -> list[Path]:
    """Write every pinned file below ``out``, path-preserving; with
    ``overlay`` the series is applied first. Returns the files written."""
    texts = dict(bases)
    if overlay:
        texts.update(overlay_texts(bases, series))
    written = []
    for path, text in sorted(texts.items()):
        dest = out / path
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        except OSError as e:
            where = e.filename or dest
            raise MaterializeError(
                f"--out {out}: cannot write {where}: {e.strerror}"
            ) from None
        written.append(dest)
    return written
