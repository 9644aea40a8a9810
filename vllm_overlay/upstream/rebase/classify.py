"""One patch's files against the new base: clean, offset, upstream or
conflict (a 3-way merge written out for review)."""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.series.diff import FilePatch, Hunk, HunkError, apply_file_patch
from vllm_overlay.series.patch_series import SeriesPatch
from vllm_overlay.text import count, verb
from vllm_overlay.upstream.rebase.report import HunkNote, RebaseError, Result


@dataclass(frozen=True)
class Merge:
    text: str
    conflicts: int


def merge_file(
    ours: str, base: str, theirs: str, labels: tuple[str, str, str]
) -> Merge:
    """``git merge-file -p``: the 3-way merge and its number of conflicts."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-merge-") as tmp:
        paths = []
        for name, text in (("ours", ours), ("base", base), ("theirs", theirs)):
            p = Path(tmp) / name
            p.write_text(text)
            paths.append(str(p))
        cmd = ["git", "merge-file", "-p"]
        for label in labels:
            cmd += ["-L", label]
        run = subprocess.run(cmd + paths, capture_output=True)
    if run.returncode < 0 or run.returncode > 127:
        raise RebaseError(f"git merge-file failed: {run.stderr.decode().strip()}")
    return Merge(run.stdout.decode(), run.returncode)


@dataclass
class FileOutcome:
    result: Result
    detail: str
    new_post: str | None = None
    hunks: list[HunkNote] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)


def _hunk_notes(fp: FilePatch, offsets: list[int]) -> list[HunkNote]:
    return [
        HunkNote(fp.path, k + 1, _describe(h), off)
        for k, (h, off) in enumerate(zip(fp.hunks, offsets, strict=True))
        if off
    ]


def _describe(hunk: Hunk) -> str:
    return f"{hunk.header} {hunk.section}".rstrip()


def _failed_hunks(fp: FilePatch, text: str) -> list[HunkNote]:
    notes = []
    for k, hunk in enumerate(fp.hunks):
        alone = FilePatch(fp.old_path, fp.new_path, (hunk,))
        try:
            apply_file_patch(text, alone, offset=True)
        except HunkError:
            notes.append(
                HunkNote(fp.path, k + 1, _describe(hunk), problem="context not found")
            )
    return notes


def classify_file(
    patch: SeriesPatch,
    fp: FilePatch,
    old_pre: str,
    old_post: str,
    new_pre: str | None,
    labels: tuple[str, str],
    workdir: Path,
) -> FileOutcome:
    if new_pre is None:
        return FileOutcome("conflict", f"{fp.path} is not in the new base")
    try:
        done = apply_file_patch(new_pre, fp)
        return FileOutcome("clean", "", done.text, offsets=[0] * len(fp.hunks))
    except HunkError:
        pass
    try:
        apply_file_patch(new_pre, fp.reversed(), offset=True)
        return FileOutcome("upstream", f"{file_name(fp)}: the patch reverse-applies")
    except HunkError:
        pass
    try:
        done = apply_file_patch(new_pre, fp, offset=True)
        offsets = [h.offset for h in done.hunks]
        return FileOutcome(
            "offset", "", done.text, _hunk_notes(fp, offsets), offsets=offsets
        )
    except HunkError:
        pass
    new_label, old_label = labels
    merge = merge_file(new_pre, old_pre, old_post, (new_label, old_label, patch.slug))
    if merge.conflicts == 0 and merge.text == new_pre:
        return FileOutcome(
            "upstream", f"{file_name(fp)}: a 3-way merge of the patch changes nothing"
        )
    merged = _write_merge(
        workdir / patch.slug, file_name(fp), merge.text, (new_pre, old_pre, old_post)
    )
    failed = _failed_hunks(fp, new_pre)
    markers = [
        f"{merged}:{i}"
        for i, line in enumerate(merge.text.splitlines(), 1)
        if line.startswith("<<<<<<< ")
    ]
    detail = _conflict_detail(file_name(fp), merge, failed)
    return FileOutcome(
        "conflict", detail, hunks=failed, merged=[merged], conflicts=markers
    )


def _write_merge(
    out: Path, stem: str, merged: str, inputs: tuple[str, str, str]
) -> str:
    """The merge with its three inputs, for review; the merge's path."""
    out.mkdir(parents=True, exist_ok=True)
    names = ("merged", "new-base", "old-base", "old-patched")
    for suffix, text in zip(names, (merged, *inputs), strict=True):
        (out / f"{stem}.{suffix}").write_text(text)
    return str(out / f"{stem}.merged")


def _conflict_detail(stem: str, merge: Merge, failed: list[HunkNote]) -> str:
    """A short summary; the table lists each conflict (``path:line`` of the
    ``.merged`` file) and each hunk on its own line."""
    hunks = (
        f"{count(len(failed), 'hunk')} {verb(len(failed), 'does', 'do')} not apply"
        if failed
        else "every hunk applies"
    )
    if not merge.conflicts:
        return (
            f"{stem}: context changed ({hunks}); the 3-way merge is clean but "
            "needs review"
        )
    return f"{stem}: {count(merge.conflicts, 'conflict')}; {hunks}"


def file_name(fp: FilePatch) -> str:
    return fp.path.rsplit("/", 1)[-1]


def combine(outcomes: list[FileOutcome]) -> tuple[Result, str]:
    kinds = {o.result for o in outcomes}
    details = [o.detail for o in outcomes if o.detail]
    if "blocked" in kinds:
        return "blocked", "; ".join(details)
    if "conflict" in kinds:
        return "conflict", "; ".join(d for o in outcomes if (d := o.detail))
    if kinds == {"upstream"}:
        return "upstream", "; ".join(details) + "; proposed for removal"
    if "upstream" in kinds:
        up = [d for o in outcomes if o.result == "upstream" and (d := o.detail)]
        return "conflict", "partly upstream (" + "; ".join(up) + "), rest not"
    if "offset" in kinds:
        return "offset", ""
    return "clean", ""
