"""The core series: `patches/core/`, fixes to vLLM core files, upstream-only.

Some connector patches work around bugs in vLLM core. The core series holds
the fix of each as its own patch (``cNNN-<slug>.patch``, listed in
``patches/core/series``, DEP-3 headers like the connector series), against
the core files ``pin.toml``'s ``core_files`` pins. It is exported as
upstream pull requests and used to prove a workaround removable; it is never
applied to an install and never shipped in the image.

A connector patch names the core fix that replaces it in its Remove-When:
``core patch c001 (bundle c001-<slug>) ...``.
"""

from __future__ import annotations

import re
from pathlib import Path

from vllm_overlay.series.diff import DiffError, parse_patch
from vllm_overlay.series.patch_series import (
    PATCH_DIR,
    PatchHeader,
    Series,
    SeriesError,
    SeriesPatch,
    _author_problems,
    _read_text,
    _series_problems,
    entry_problems,
    header_problems,
    load_listed,
    read_series_file,
    split_header,
)
from vllm_overlay.series.pin import Pin

CORE_DIR = "core"
_NAME_RE = re.compile(r"^c\d{3}-[a-z0-9][a-z0-9-]*\.patch$")
_REMOVE_WHEN_RE = re.compile(r"\bcore patch (c\d{3})\b")
_BUNDLE_RE = re.compile(r"\(bundle ([a-z0-9-]+)\)")


def core_dir(root: Path) -> Path:
    return root / PATCH_DIR / CORE_DIR


def core_key(patch: SeriesPatch) -> str:
    """``c001`` for ``c001-<slug>.patch``."""
    return patch.name.split("-", 1)[0]


def core_fix(header: PatchHeader) -> str | None:
    """The core patch (``c001``) a workaround's Remove-When names, or None."""
    m = _REMOVE_WHEN_RE.search(header.remove_when)
    return m.group(1) if m else None


def has_core_series(root: Path) -> bool:
    return (core_dir(root) / "series").is_file()


def load_core_series(root: Path) -> Series:
    """The core series; empty when the checkout has none."""
    directory = core_dir(root)
    if not has_core_series(root):
        return Series(root, ())
    names = read_series_file(directory)
    bad = entry_problems(names) + [
        f"core series entry {n!r} is not named cNNN-<slug>.patch"
        for n in names
        if not _NAME_RE.match(n)
    ]
    return load_listed(root, directory, names, bad, "core series")


def find_core_patch(core: Series, key: str) -> SeriesPatch:
    for p in core.patches:
        if core_key(p) == key:
            return p
    raise SeriesError(
        f"no core patch {key} in {PATCH_DIR}/{CORE_DIR}/series (it holds "
        f"{', '.join(core_key(p) for p in core.patches) or 'none'})"
    )


def check_core_series(root: Path, pin: Pin, connector: Series | None) -> list[str]:
    """Every problem of the core series (none when there is no core series),
    and of the connector patches' Remove-When naming a core patch."""
    directory = core_dir(root)
    if not has_core_series(root):
        names: list[str] = []
    else:
        try:
            names = read_series_file(directory)
        except SeriesError as e:
            return [str(e)]
    problems = [f"core: {p}" for p in entry_problems(names)]
    problems += [
        f"core: series entry {n!r} is not named cNNN-<slug>.patch"
        for n in names
        if not _NAME_RE.match(n)
    ]
    on_disk = (
        {p.name for p in directory.glob("*.patch")} if directory.is_dir() else set()
    )
    problems += [
        f"core: {n} is in {PATCH_DIR}/{CORE_DIR}/ but not listed in its series"
        for n in sorted(on_disk - set(names))
    ]
    loaded: list[SeriesPatch] = []
    for i, name in enumerate(dict.fromkeys(names), 1):
        path = directory / name
        label = f"{CORE_DIR}/{name}"
        try:
            text = _read_text(path, label)
            head, body = split_header(text, label)
            files = tuple(parse_patch(body))
        except SeriesError as e:
            problems.append(str(e))
            continue
        except DiffError as e:
            problems.append(f"{label}: not a unified diff: {e}")
            continue
        header, issues = header_problems(head, label)
        problems += issues
        problems += [
            f"{label}: touches {fp.path}, which pin.toml's core_files does not pin"
            for fp in files
            if fp.path not in pin.core_files
        ]
        if header is not None:
            loaded.append(SeriesPatch(i, name, path, text, header, files))
    problems += _author_problems(root / PATCH_DIR, loaded)
    problems += _series_problems(root, loaded, True)
    slugs = {core_key(p): p.slug for p in loaded}
    for p in connector.patches if connector is not None else ():
        key = core_fix(p.header)
        if key is None:
            continue
        if key not in slugs:
            problems.append(
                f"{p.name}: Remove-When names core patch {key}, which "
                f"{PATCH_DIR}/{CORE_DIR}/series does not list"
            )
            continue
        bundle = _BUNDLE_RE.search(p.header.remove_when)
        if bundle is None or bundle.group(1) != slugs[key]:
            problems.append(
                f"{p.name}: Remove-When names core patch {key} without its "
                f"bundle; write 'core patch {key} (bundle {slugs[key]})'"
            )
    return problems
