"""One patch's files against the new base: clean, offset, upstream, partly
upstream (some hunks landed, the rest carried) or conflict (a 3-way merge
written out for review). Each hunk also gets its state (landed, changed
upstream, still to carry, conflicting), which ``anotherform`` weighs."""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.series.diff import FilePatch, Hunk, HunkError, apply_file_patch
from vllm_overlay.series.patch_series import SeriesPatch
from vllm_overlay.text import count, verb
from vllm_overlay.upstream.rebase.landed import HunkCheck, check_hunks
from vllm_overlay.upstream.rebase.report import (
    HunkNote,
    HunkState,
    RebaseError,
    Result,
)


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
    # The hunks carried onto the new base (0-based; every hunk unless some
    # landed) and the offset at which each applies there.
    kept: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    # Each hunk's state (0-based index); empty for a blocked file.
    states: dict[int, HunkState] = field(default_factory=dict)


@dataclass(frozen=True)
class FileInput:
    """One file of a patch: the texts it meets on both bases."""

    fp: FilePatch
    old_pre: str  # the pinned base with the patches below
    old_post: str  # ... and this one
    new_pre: str | None  # the new base with the patches carried so far
    blocked_by: str = ""  # the earlier patch that conflicts in this file


def _describe(hunk: Hunk) -> str:
    return f"{hunk.header} {hunk.section}".rstrip()


def _numbers(indexes: list[int]) -> str:
    return " ".join(f"#{k + 1}" for k in indexes)


def classify_patch(
    patch: SeriesPatch,
    inputs: list[FileInput],
    labels: tuple[str, str],
    workdir: Path,
) -> list[FileOutcome]:
    """Each file of ``patch`` against the new base, in order.

    A file whose hunks apply exactly is clean. Otherwise each hunk is looked
    for in the new base (``landed``); a hunk without evidence of its own
    counts as landed only when its post-image is there verbatim and another
    hunk of the patch landed on its own evidence."""
    outcomes: dict[int, FileOutcome] = {}
    checks: dict[int, list[HunkCheck]] = {}
    for i, inp in enumerate(inputs):
        name = file_name(inp.fp)
        if inp.blocked_by:
            why = f"{name}: not assessed, {inp.blocked_by} conflicts there"
            outcomes[i] = FileOutcome("blocked", why)
        elif inp.new_pre is None:
            missing = f"{inp.fp.path} is not in the new base"
            states = _every(inp.fp, "conflicting")
            outcomes[i] = FileOutcome("conflict", missing, states=states)
        else:
            try:
                done = apply_file_patch(inp.new_pre, inp.fp)
            except HunkError:
                checks[i] = check_hunks(inp.old_pre, inp.new_pre, inp.fp)
                continue
            every = list(range(len(inp.fp.hunks)))
            outcomes[i] = FileOutcome(
                "clean",
                "",
                done.text,
                kept=every,
                offsets=[0] * len(every),
                states=_every(inp.fp, "still to carry"),
            )
    evidence = any(c.landed for cs in checks.values() for c in cs)
    for i, cs in checks.items():
        landed = {
            c.index: c.landed_summary()
            if c.landed
            else c.landed_summary(trivial_follows=True)
            for c in cs
            if c.landed or (evidence and not c.has_evidence and c.post_at is not None)
        }
        outcomes[i] = _classify_file(patch, inputs[i], cs, landed, labels, workdir)
    return [outcomes[i] for i in range(len(inputs))]


def _every(fp: FilePatch, state: HunkState) -> dict[int, HunkState]:
    return dict.fromkeys(range(len(fp.hunks)), state)


def _classify_file(
    patch: SeriesPatch,
    inp: FileInput,
    checks: list[HunkCheck],
    landed: dict[int, str],
    labels: tuple[str, str],
    workdir: Path,
) -> FileOutcome:
    fp, new_pre = inp.fp, inp.new_pre
    assert new_pre is not None
    name = file_name(fp)
    notes = [
        HunkNote(
            fp.path,
            c.index + 1,
            _describe(c.hunk),
            landed=landed[c.index],
            evidence=c.evidence(),
            state="landed",
        )
        for c in checks
        if c.index in landed
    ]
    kept = [k for k in range(len(fp.hunks)) if k not in landed]
    states: dict[int, HunkState] = dict.fromkeys(landed, "landed")
    if not kept:
        return FileOutcome(
            "upstream",
            f"{name}: every hunk landed ({len(fp.hunks)})",
            hunks=notes,
            states=states,
        )
    rest = FilePatch(fp.old_path, fp.new_path, tuple(fp.hunks[k] for k in kept))
    try:
        done = apply_file_patch(new_pre, rest, offset=True)
    except HunkError:
        pass
    else:
        offsets = [h.offset for h in done.hunks]
        notes += [
            HunkNote(fp.path, k + 1, _describe(fp.hunks[k]), off)
            for k, off in zip(kept, offsets, strict=True)
            if off
        ]
        notes.sort(key=lambda n: n.hunk)
        states.update(dict.fromkeys(kept, "still to carry"))
        if not landed:
            return FileOutcome(
                "offset", "", done.text, notes, kept, offsets, states=states
            )
        detail = (
            f"{name}: hunk(s) {_numbers(sorted(landed))} landed; "
            f"{_numbers(kept)} carried (the remainder)"
        )
        return FileOutcome(
            "partly upstream", detail, done.text, notes, kept, offsets, states=states
        )
    # The review merge leaves out what landed: new base, old base, and the
    # old base with the hunks that did not.
    theirs = apply_file_patch(inp.old_pre, rest).text
    new_label, old_label = labels
    merge = merge_file(new_pre, inp.old_pre, theirs, (new_label, old_label, patch.slug))
    merged = _write_merge(
        workdir / patch.slug, name, merge.text, (new_pre, inp.old_pre, theirs)
    )
    by_index = {c.index: c for c in checks}
    failed = []
    for k in kept:
        if _applies_alone(new_pre, fp, k):
            states[k] = "still to carry"
            continue
        check = by_index[k]
        states[k] = "changed upstream" if check.in_another_form else "conflicting"
        failed.append(
            HunkNote(
                fp.path,
                k + 1,
                _describe(fp.hunks[k]),
                problem=check.problem(),
                state=states[k],
            )
        )
    carried = [
        HunkNote(fp.path, k + 1, _describe(fp.hunks[k]), state="still to carry")
        for k in kept
        if states[k] == "still to carry"
    ]
    markers = [
        f"{merged}:{i}"
        for i, line in enumerate(merge.text.splitlines(), 1)
        if line.startswith("<<<<<<< ")
    ]
    detail = _conflict_detail(name, merge, failed, sorted(landed))
    return FileOutcome(
        "conflict",
        detail,
        hunks=sorted(notes + failed + carried, key=lambda n: n.hunk),
        merged=[merged],
        conflicts=markers,
        states=states,
    )


def _applies_alone(text: str, fp: FilePatch, k: int) -> bool:
    alone = FilePatch(fp.old_path, fp.new_path, (fp.hunks[k],))
    try:
        apply_file_patch(text, alone, offset=True)
    except HunkError:
        return False
    return True


def _write_merge(
    out: Path, stem: str, merged: str, inputs: tuple[str, str, str]
) -> str:
    """The merge with its three inputs, for review; the merge's path."""
    out.mkdir(parents=True, exist_ok=True)
    names = ("merged", "new-base", "old-base", "old-patched")
    for suffix, text in zip(names, (merged, *inputs), strict=True):
        (out / f"{stem}.{suffix}").write_text(text)
    return str(out / f"{stem}.merged")


def _conflict_detail(
    stem: str, merge: Merge, failed: list[HunkNote], landed: list[int]
) -> str:
    """A short summary; the table lists each conflict (``path:line`` of the
    ``.merged`` file), each landed hunk and each hunk on its own line."""
    changed = sum(1 for h in failed if "changed upstream" in h.problem)
    hunks = (
        f"{count(len(failed), 'hunk')} {verb(len(failed), 'does', 'do')} not apply"
        if failed
        else "every hunk applies"
    )
    if changed:
        hunks += f" ({changed} changed upstream)"
    prefix = f"{stem}: "
    if landed:
        prefix += f"partly upstream: hunk(s) {_numbers(landed)} landed; the rest: "
    if not merge.conflicts:
        return (
            f"{prefix}context changed ({hunks}); the 3-way merge is clean but "
            "needs review"
        )
    return f"{prefix}{count(merge.conflicts, 'conflict')}; {hunks}"


def file_name(fp: FilePatch) -> str:
    return fp.path.rsplit("/", 1)[-1]


def combine(outcomes: list[FileOutcome]) -> tuple[Result, str]:
    kinds = {o.result for o in outcomes}
    details = [o.detail for o in outcomes if o.detail]
    if "blocked" in kinds:
        return "blocked", "; ".join(details)
    if "conflict" in kinds:
        # A file that landed next to one that conflicts: say so first.
        part = "partly upstream: " if kinds & {"upstream", "partly upstream"} else ""
        return "conflict", part + "; ".join(details)
    if kinds == {"upstream"}:
        return "upstream", "; ".join(details) + "; proposed for removal"
    if kinds & {"upstream", "partly upstream"}:
        return "partly upstream", "; ".join(details)
    if "offset" in kinds:
        return "offset", ""
    return "clean", ""
