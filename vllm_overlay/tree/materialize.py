"""Write the base or overlaid MoRIIO files out of a vLLM tree or the pinned wheel."""

from __future__ import annotations

import zipfile
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.series.patch_series import Series
from vllm_overlay.series.pin import Pin, sha256_bytes, sha256_file
from vllm_overlay.tree.apply import overlay_texts
from vllm_overlay.tree.status import tree_status
from vllm_overlay.tree.target import Target


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
    actual = sha256_file(wheel)
    if actual != pin.vllm.wheel_sha256:
        raise MaterializeError(
            f"{wheel}: sha256 {actual} is not the pinned wheel's "
            f"{pin.vllm.wheel_sha256}"
        )
    out: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as zf:
        for path, sha in pin.files.items():
            data = zf.read(path)
            if sha256_bytes(data) != sha:
                raise MaterializeError(f"{wheel}!{path}: does not match the pin")
            out[path] = data.decode()
    return out


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
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        written.append(dest)
    return written
