"""``--refreshed PATCH``: a hand-refreshed version of a patch, used in its
place on the new base.

A patch that landed upstream in another form cannot be refreshed
mechanically; a person writes its remainder (docs/upstream.md, "re-basing
by hand") and gives it back here. The file is named as the patch it
replaces (``0001-....patch``), is a DEP-3 patch made for the new base, and
its header says ``Applied-Upstream: <new version> (in part)``. It is
applied to the new base's chain (exactly, or with offsets) instead of the
patch; the patches above are then assessed on top of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.series.diff import FilePatch, HunkError, apply_file_patch
from vllm_overlay.series.patch_series import (
    Series,
    SeriesError,
    SeriesPatch,
    load_patch,
)
from vllm_overlay.upstream.rebase.report import HunkNote, RebaseError, Result


def in_part(version: str) -> str:
    """What a hand-refreshed remainder's Applied-Upstream says."""
    return f"{version} (in part)"


def load_refreshed(
    paths: list[Path], series: Series, version: str
) -> dict[str, SeriesPatch]:
    """The hand-refreshed patches by the name of the patch each replaces;
    a ``RebaseError`` (one line) for a file that is not one."""
    given: dict[str, SeriesPatch] = {}
    index = {name: k for k, name in enumerate(series.names, 1)}
    for path in paths:
        where = f"--refreshed {path}"
        if not path.is_file():
            raise RebaseError(f"{where}: no such file")
        if path.name not in index:
            raise RebaseError(
                f"{where}: names no patch of the series (the file is named as "
                f"the patch it replaces, e.g. {series.names[0]})"
                if series.names
                else f"{where}: the series has no patch"
            )
        if path.name in given:
            raise RebaseError(f"{where}: {path.name} is given twice")
        try:
            patch = load_patch(path, index[path.name])
        except SeriesError as e:
            raise RebaseError(f"{where}: {e}") from None
        if not patch.files:
            raise RebaseError(f"{where}: changes no file")
        wanted = in_part(version)
        if patch.header.applied_upstream != wanted:
            said = patch.header.applied_upstream or "(empty)"
            raise RebaseError(
                f"{where}: Applied-Upstream is {said}; a hand-refreshed "
                f"remainder of a patch vLLM {version} has in part says "
                f"'Applied-Upstream: {wanted}'"
            )
        given[path.name] = patch
    return given


@dataclass
class Carried:
    """A hand-refreshed patch on the new base's chain."""

    result: Result  # clean, offset or conflict
    posts: dict[str, str] = field(default_factory=dict)  # path -> text after
    offsets: dict[str, list[int]] = field(default_factory=dict)
    failed: list[HunkNote] = field(default_factory=list)


def carry(patch: SeriesPatch, chain: dict[str, str]) -> Carried:
    """``patch`` applied to the new base's chain: every file exactly
    (clean), with offsets (offset), or some hunk not found (conflict: the
    hunks that do not apply, each on its own)."""
    out = Carried("clean")
    for fp in patch.files:
        text = chain.get(fp.path)
        if text is None:
            out.failed.append(
                HunkNote(fp.path, 1, "", problem=f"{fp.path} is not in the new base")
            )
            continue
        try:
            done = apply_file_patch(text, fp, offset=True)
        except HunkError:
            for k, hunk in enumerate(fp.hunks):
                try:
                    apply_file_patch(text, _alone(fp, k), offset=True)
                except HunkError:
                    header = f"{hunk.header} {hunk.section}".rstrip()
                    note = HunkNote(fp.path, k + 1, header, problem="context not found")
                    out.failed.append(note)
            if not any(n.file == fp.path for n in out.failed):
                out.failed.append(
                    HunkNote(fp.path, 1, "", problem="its hunks do not apply together")
                )
            continue
        out.posts[fp.path] = done.text
        out.offsets[fp.path] = [h.offset for h in done.hunks]
    if out.failed:
        out.result = "conflict"
    elif any(any(offs) for offs in out.offsets.values()):
        out.result = "offset"
    return out


def _alone(fp: FilePatch, k: int) -> FilePatch:
    return FilePatch(fp.old_path, fp.new_path, (fp.hunks[k],))
