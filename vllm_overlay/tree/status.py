"""What state a vLLM tree's MoRIIO files are in: base, overlaid, or neither.

A file is ``base`` (the pinned bytes), ``overlaid`` (the base with every
patch of the series that touches it), ``stale`` (the base with the patches
the manifest records, an earlier series), ``partial`` (the base with only a
prefix of its patches, and no manifest saying so), ``unknown`` or
``missing``. The manifest is checked against the bytes; an interrupted
write (a journal), a running apply (the lock) and leftover temporary files
are reported as notes.
"""

from __future__ import annotations

import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from vllm_overlay.safefile import (
    MAX_READ_BYTES,
    NotRegularError,
    TooLargeError,
    read_regular,
)
from vllm_overlay.series.diff import (
    DiffError,
    FilePatch,
    HunkError,
    apply_file_patch,
    parse_patch,
)
from vllm_overlay.series.patch_series import Series, SeriesError, split_header
from vllm_overlay.series.pin import Pin, module_files, sha256_bytes
from vllm_overlay.text import count as count_of
from vllm_overlay.transaction import Transaction, TransactionError, lock_holder
from vllm_overlay.tree.manifest import MANIFEST_NAME, Manifest, load_manifest
from vllm_overlay.tree.target import Target

FileStateName = Literal["base", "overlaid", "partial", "stale", "unknown", "missing"]
TreeStateName = Literal["base", "overlaid", "partial", "stale", "unknown"]


class FileStatus(msgspec.Struct):
    path: str
    state: FileStateName
    patches: list[str]
    expected_sha256: str
    actual_sha256: str
    overlaid_sha256: str = ""
    detail: str = ""
    pinned: bool = True


class StatusReport(msgspec.Struct):
    target: str
    state: TreeStateName
    series_id: str
    patches: list[str]
    files: list[FileStatus]
    manifest_series_id: str = ""
    # "ok", "absent" (a base tree has none), "missing", "invalid: ...",
    # "stale: ..." (it does not describe the bytes).
    manifest: str = ""
    # What needs attention besides the states: an interrupted write, a
    # running apply, leftovers, a manifest to repair.
    notes: list[str] = []

    @property
    def clean(self) -> bool:
        """Base or overlaid, with nothing to repair."""
        return self.state in ("base", "overlaid") and not self.notes


@dataclass(frozen=True)
class Peeled:
    count: int  # how many of the file's patches were peeled off
    base_text: str


def peel(text: str, file_patches: Sequence[FilePatch], base_sha: str) -> Peeled | None:
    """Find the longest prefix of ``file_patches`` whose reverse application
    turns ``text`` into the pinned base; None when no prefix does."""
    for count in range(len(file_patches), 0, -1):
        current = text
        try:
            for fp in reversed(file_patches[:count]):
                current = apply_file_patch(current, fp.reversed()).text
        except HunkError:
            continue
        if sha256_bytes(current.encode()) == base_sha:
            return Peeled(count, current)
    return None


def manifest_file_patches(manifest: Manifest, path: str) -> list[FilePatch]:
    """The file patches the manifest records for ``path``; raises
    ``SeriesError`` or ``DiffError`` when a recorded patch is not one."""
    out: list[FilePatch] = []
    for applied in manifest.patches:
        _, body = split_header(applied.text, applied.name)
        out.extend(fp for fp in parse_patch(body) if fp.path == path)
    return out


def file_status(
    target: Target, pin: Pin, series: Series, manifest: Manifest | None, path: str
) -> tuple[FileStatus, str | None]:
    """Classify one pinned file; also return its base text when known."""
    expected = pin.files[path]
    try:
        data = read_pinned(target.file(path))
    except FileNotFoundError:
        return FileStatus(path, "missing", [], expected, ""), None
    except NotRegularError as e:
        if stat.S_ISDIR(e.st.st_mode):
            return FileStatus(path, "missing", [], expected, ""), None
        return FileStatus(path, "unknown", [], expected, "", detail=e.why), None
    except TooLargeError as e:
        return FileStatus(path, "unknown", [], expected, "", detail=e.why), None
    actual = sha256_bytes(data)
    if actual == expected:
        return FileStatus(path, "base", [], expected, actual), data.decode()
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        detail = f"not UTF-8 text (byte {e.start})"
        return FileStatus(path, "unknown", [], expected, actual, detail=detail), None
    own = series.patches_for(path)
    mine = peel(text, [fp for p in own for fp in p.files if fp.path == path], expected)
    if mine is not None and mine.count == len(own):
        names = [p.name for p in own]
        return FileStatus(path, "overlaid", names, expected, actual, actual), (
            mine.base_text
        )
    recorded = _recorded(manifest, path)
    earlier = peel(text, recorded, expected) if recorded else None
    if manifest is not None and earlier is not None:
        detail = f"overlaid by an earlier series ({manifest.series_id})"
        overlaid = manifest.files[path].overlaid_sha256
        status = FileStatus(
            path, "stale", manifest.patch_names, expected, actual, overlaid, detail
        )
        return status, earlier.base_text
    if mine is not None:
        names = [p.name for p in own[: mine.count]]
        detail = f"{len(names)} of its {len(own)} patches, no manifest records it"
        status = FileStatus(path, "partial", names, expected, actual, actual, detail)
        return status, mine.base_text
    recorded_sha = ""
    if manifest is not None and path in manifest.files:
        recorded_sha = manifest.files[path].overlaid_sha256
    detail = "matches neither the pinned base nor the base with the series"
    return (
        FileStatus(path, "unknown", [], expected, actual, recorded_sha, detail),
        None,
    )


def read_pinned(file: Path) -> bytes:
    """A pinned file's bytes: never read through a symlink, and its size
    checked against the cap before it is read."""
    return read_regular(file, MAX_READ_BYTES, "a pinned file")


def _recorded(manifest: Manifest | None, path: str) -> list[FilePatch]:
    """The file patches the manifest records for ``path`` (none when the
    manifest does not hold a readable patch for it)."""
    if manifest is None or path not in manifest.files:
        return []
    try:
        return manifest_file_patches(manifest, path)
    except (SeriesError, DiffError):
        return []


def _tree_state(files: list[FileStatus], touched: set[str]) -> TreeStateName:
    states = {f.state for f in files}
    if states <= {"base"}:
        return "base"
    if states & {"unknown", "missing"}:
        return "unknown"
    if "stale" in states:
        return "stale"
    if all(f.state == ("overlaid" if f.path in touched else "base") for f in files):
        return "overlaid"
    return "partial"


def _manifest_verdict(
    state: TreeStateName,
    manifest: Manifest | None,
    problem: str,
    series: Series,
    files: list[FileStatus],
) -> str:
    """Whether the manifest describes the bytes: "ok", "absent" (a base
    tree has none), "missing", "invalid: ...", "stale: ..."."""
    if problem:
        return f"invalid: {problem}"
    if manifest is None:
        return "absent" if state == "base" else "missing"
    for applied in manifest.patches:
        try:
            _, body = split_header(applied.text, applied.name)
            parse_patch(body)
        except (SeriesError, DiffError) as e:
            return f"invalid: {applied.name} as recorded is not a patch ({e})"
    if state == "base":
        return f"stale: records series {manifest.series_id} on a base tree"
    if state == "overlaid":
        recorded = {p: f.overlaid_sha256 for p, f in manifest.files.items()}
        actual = {f.path: f.actual_sha256 for f in files if f.state == "overlaid"}
        if manifest.series_id != series.series_id or recorded != actual:
            return f"stale: records series {manifest.series_id}"
    return "ok"


def tree_status(
    target: Target, pin: Pin, series: Series
) -> tuple[StatusReport, dict[str, str]]:
    """Classify every pinned file (and any unpinned file in the module).

    Returns the report and the base text of every file whose base is known.
    """
    module_dir = target.module_dir()
    dirs = {target.file(p).parent for p in pin.files}
    manifest, problem = load_manifest(module_dir / MANIFEST_NAME)
    files: list[FileStatus] = []
    bases: dict[str, str] = {}
    for path in sorted(pin.files):
        status, base = file_status(target, pin, series, manifest, path)
        files.append(status)
        if base is not None:
            bases[path] = base
    if module_dir.is_dir():
        for path, sha in module_files(module_dir, pin.module).items():
            if path not in pin.files:
                files.append(
                    FileStatus(
                        path,
                        "unknown",
                        [],
                        "",
                        sha,
                        detail="not in the pin" if sha else "a symlink, not in the pin",
                        pinned=False,
                    )
                )
    state = _tree_state(files, set(series.touched_paths()))
    verdict = _manifest_verdict(state, manifest, problem, series, files)
    if verdict == "missing" and target.kind == "files":
        # `materialize` writes the files alone: nothing to repair there.
        verdict = "absent"
    report = StatusReport(
        target=target.describe(),
        state=state,
        series_id=series.series_id,
        patches=series.names,
        files=files,
        manifest_series_id=manifest.series_id if manifest else "",
        manifest=verdict,
        notes=_notes(Transaction(module_dir, dirs), state, verdict),
    )
    return report, bases


def _notes(txn: Transaction, state: TreeStateName, manifest: str) -> list[str]:
    notes = []
    holder = lock_holder(txn.root) if txn.root.is_dir() else None
    if holder is not None:
        notes.append(f"an apply is running (pid {holder or 'unknown'})")
    try:
        interrupted = txn.read_journal() is not None
    except TransactionError as e:
        notes.append(str(e))
        interrupted = False
    if interrupted and holder is None:
        notes.append(
            "an apply was interrupted: `vllm-overlay apply` or `apply --revert` "
            "undoes it first"
        )
    planted = txn.planted()
    notes.extend(f"{line}: not the overlay's, remove it by hand" for line in planted)
    stray = txn.leftovers()
    if stray and not interrupted and holder is None and not planted:
        notes.append(
            f"{count_of(len(stray), 'leftover temporary file')}, e.g. "
            f"{stray[0].name}: the next apply removes them"
        )
    if state in ("base", "overlaid") and manifest not in ("ok", "absent"):
        fix = "apply --revert removes it" if state == "base" else "apply rewrites it"
        notes.append(f"the manifest is {manifest.split(':')[0]}: {fix}")
    return notes


def format_status(report: StatusReport) -> str:
    width = max((len(f.path) for f in report.files), default=0)
    lines = [f"target: {report.target}"]
    series_line = f"series: {report.series_id} ({len(report.patches)} patches)"
    recorded = report.manifest_series_id
    if recorded and recorded != report.series_id:
        series_line += f"; manifest records series {recorded}"
    lines.append(series_line)
    for f in report.files:
        line = f"  {f.path:<{width}}  {f.state}"
        if f.patches:
            line += "  " + ", ".join(n.split("-", 1)[0] for n in f.patches)
        if f.state in ("unknown", "stale", "missing", "partial"):
            if f.detail:
                line += f"  ({f.detail})"
            if f.pinned:
                line += f"\n      expected {f.expected_sha256 or '-'}"
                if f.overlaid_sha256:
                    line += f" (base) or {f.overlaid_sha256} (overlaid)"
                line += f"\n      actual   {f.actual_sha256 or '-'}"
        lines.append(line)
    lines.append(f"manifest: {report.manifest}")
    lines.extend(f"note: {note}" for note in report.notes)
    counts: dict[str, int] = {}
    for f in report.files:
        counts[f.state] = counts.get(f.state, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    lines.append(f"status: {report.state} ({len(report.files)} files: {summary})")
    return "\n".join(lines)
