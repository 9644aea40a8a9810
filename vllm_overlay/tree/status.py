"""What state a vLLM tree's MoRIIO files are in: base, overlaid, or neither."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from vllm_overlay.series.diff import FilePatch, HunkError, apply_file_patch, parse_patch
from vllm_overlay.series.patch_series import Series, split_header
from vllm_overlay.series.pin import Pin, module_files, sha256_bytes
from vllm_overlay.tree.manifest import Manifest, manifest_path, read_manifest
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


class StatusReport(msgspec.Struct):
    target: str
    state: TreeStateName
    series_id: str
    patches: list[str]
    files: list[FileStatus]
    manifest_series_id: str = ""


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
    file = target.file(path)
    if not file.is_file():
        return FileStatus(path, "missing", [], expected, ""), None
    data = file.read_bytes()
    actual = sha256_bytes(data)
    if actual == expected:
        return FileStatus(path, "base", [], expected, actual), data.decode()
    text = data.decode(errors="surrogateescape")
    own = series.patches_for(path)
    own_files = [fp for p in own for fp in p.files if fp.path == path]
    peeled = peel(text, own_files, expected)
    if peeled is not None:
        state: FileStateName = "overlaid" if peeled.count == len(own) else "partial"
        names = [p.name for p in own[: peeled.count]]
        status = FileStatus(path, state, names, expected, actual, actual)
        return status, peeled.base_text
    if manifest is not None and path in manifest.files:
        stale = peel(text, manifest_file_patches(manifest, path), expected)
        if stale is not None:
            return (
                FileStatus(
                    path,
                    "stale",
                    manifest.patch_names,
                    expected,
                    actual,
                    manifest.files[path].overlaid_sha256,
                    f"overlaid by an earlier series ({manifest.series_id})",
                ),
                stale.base_text,
            )
    recorded = manifest.files.get(path) if manifest is not None else None
    overlaid = recorded.overlaid_sha256 if recorded is not None else ""
    return (
        FileStatus(
            path,
            "unknown",
            [],
            expected,
            actual,
            overlaid,
            "matches neither the pinned base nor the base with the series",
        ),
        None,
    )


def tree_status(
    target: Target, pin: Pin, series: Series
) -> tuple[StatusReport, dict[str, str]]:
    """Classify every pinned file (and any unpinned file in the module).

    Returns the report and the base text of every file whose base is known.
    """
    manifest = read_manifest(manifest_path(target.root, pin.module))
    files: list[FileStatus] = []
    bases: dict[str, str] = {}
    for path in sorted(pin.files):
        status, base = file_status(target, pin, series, manifest, path)
        files.append(status)
        if base is not None:
            bases[path] = base
    if (target.root / pin.module).is_dir():
        for path, sha in module_files(target.root, pin.module).items():
            if path not in pin.files:
                files.append(
                    FileStatus(path, "unknown", [], "", sha, detail="not in the pin")
                )
    touched = set(series.touched_paths())
    states = {f.state for f in files}
    state: TreeStateName
    if states <= {"base"}:
        state = "base"
    elif states & {"unknown", "missing"}:
        state = "unknown"
    elif "stale" in states:
        state = "stale"
    elif all(f.state == ("overlaid" if f.path in touched else "base") for f in files):
        state = "overlaid"
    else:
        state = "partial"
    report = StatusReport(
        target=target.describe(),
        state=state,
        series_id=series.series_id,
        patches=series.names,
        files=files,
        manifest_series_id=manifest.series_id if manifest else "",
    )
    return report, bases


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
        if f.state in ("unknown", "stale", "missing"):
            if f.detail:
                line += f"  ({f.detail})"
            line += f"\n      expected {f.expected_sha256 or '-'}"
            if f.overlaid_sha256:
                line += f" (base) or {f.overlaid_sha256} (overlaid)"
            line += f"\n      actual   {f.actual_sha256 or '-'}"
        lines.append(line)
    counts: dict[str, int] = {}
    for f in report.files:
        counts[f.state] = counts.get(f.state, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    lines.append(f"status: {report.state} ({len(report.files)} files: {summary})")
    return "\n".join(lines)
