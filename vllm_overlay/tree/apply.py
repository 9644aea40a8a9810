"""Apply the series to a vLLM tree, or revert it: all or nothing.

Policy: every hunk must match at the exact line its header names (no fuzz, no
offset). The series is made against the pinned base and apply refuses any
file that is not byte-identical to it, so an offset could only mean the patch
file itself was edited by hand: that is an error, not something to tolerate.

Writes go through one ``Transaction``: every new file is written next to its
target, and only when all are written are they renamed into place. A failure
restores every file already replaced and removes the temporaries, leaving the
target byte-identical to before.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_overlay import __version__
from vllm_overlay.errors import OverlayError
from vllm_overlay.series.diff import HunkError, apply_file_patch
from vllm_overlay.series.patch_series import Series
from vllm_overlay.series.pin import Pin, sha256_bytes
from vllm_overlay.transaction import Change, Transaction, TransactionError
from vllm_overlay.tree.manifest import (
    MANIFEST_NAME,
    AppliedPatch,
    Manifest,
    ManifestFile,
    encode_manifest,
    manifest_path,
)
from vllm_overlay.tree.status import StatusReport, tree_status
from vllm_overlay.tree.target import Target


class ApplyError(OverlayError):
    """The series cannot be applied or reverted; the target is unchanged."""


@dataclass(frozen=True)
class ApplyReport:
    """What `apply` (or `apply --revert`) did."""

    action: str  # "applied", "reverted", "no-op"
    message: str
    files: list[str]


def overlay_texts(bases: dict[str, str], series: Series) -> dict[str, str]:
    """The overlaid text of every file the series touches, from base texts."""
    out: dict[str, str] = {}
    for path in series.touched_paths():
        text = bases[path]
        for patch in series.patches_for(path):
            for fp in patch.files:
                if fp.path != path:
                    continue
                try:
                    text = apply_file_patch(text, fp).text
                except HunkError as e:
                    raise ApplyError(f"{patch.name}: {e}") from None
        out[path] = text
    return out


def _refuse_unless_known(report: StatusReport) -> None:
    bad = [f for f in report.files if f.state in ("unknown", "missing")]
    if not bad:
        return
    f = bad[0]
    if f.state == "missing":
        raise ApplyError(f"{f.path}: missing from the target; nothing was written")
    raise ApplyError(
        f"{f.path}: does not match the pinned base (expected sha256 "
        f"{f.expected_sha256}, actual {f.actual_sha256}); nothing was written"
    )


def apply_series(target: Target, pin: Pin, series: Series) -> ApplyReport:
    report, bases = tree_status(target, pin, series)
    _refuse_unless_known(report)
    if report.state == "overlaid":
        return ApplyReport(
            "no-op", f"already overlaid with series {series.series_id}", []
        )
    if report.state == "partial":
        raise ApplyError(
            "the target is partly overlaid (some patches of the series are "
            "missing); run with --revert first; nothing was written"
        )
    # base or stale: compute everything in memory from the known base texts.
    new_texts = overlay_texts(bases, series)
    changes = {
        path: text.encode()
        for path, text in new_texts.items()
        if target.file(path).read_bytes() != text.encode()
    }
    # A stale overlay may also cover files this series leaves alone.
    for f in report.files:
        if f.state == "stale" and f.path not in new_texts:
            changes[f.path] = bases[f.path].encode()
    manifest = Manifest(
        tool_version=__version__,
        series_id=series.series_id,
        vllm_version=pin.vllm.version,
        vllm_git_commit=pin.vllm.git_commit,
        patches=[AppliedPatch(p.name, p.text) for p in series.patches],
        files={
            path: ManifestFile(pin.files[path], sha256_bytes(text.encode()))
            for path, text in new_texts.items()
        },
    )
    _commit(target, pin, changes, encode_manifest(manifest))
    verb = "re-applied over a stale overlay" if report.state == "stale" else "applied"
    return ApplyReport(
        "applied",
        f"{verb} {len(series.patches)} patches (series {series.series_id})",
        sorted(changes),
    )


def revert_series(target: Target, pin: Pin, series: Series) -> ApplyReport:
    report, bases = tree_status(target, pin, series)
    _refuse_unless_known(report)
    if report.state == "base":
        manifest = manifest_path(target.root, pin.module)
        if manifest.exists():
            _commit(target, pin, {}, None)
        return ApplyReport("no-op", "already the pinned base", [])
    changes = {
        f.path: bases[f.path].encode() for f in report.files if f.state != "base"
    }
    _commit(target, pin, changes, None)
    return ApplyReport("reverted", "restored the pinned base", sorted(changes))


def _commit(
    target: Target, pin: Pin, changes: dict[str, bytes], manifest: bytes | None
) -> None:
    """Write ``changes`` and the manifest (None: remove it) all or nothing."""
    module = pin.module.rstrip("/") + "/"
    files = {path.removeprefix(module): Change(data) for path, data in changes.items()}
    files[MANIFEST_NAME] = Change(manifest)
    try:
        Transaction(target.root / pin.module).commit(files)
    except TransactionError as e:
        raise ApplyError(str(e)) from None
