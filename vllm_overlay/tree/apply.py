"""Apply the series to a vLLM tree, or revert it: all or nothing.

Policy: every hunk must match at the exact line its header names (no fuzz, no
offset). The series is made against the pinned base and apply refuses any
file that is not byte-identical to it or to a known overlay of it, so an
offset could only mean the patch file itself was edited by hand: that is an
error, not something to tolerate.

Both directions compute every file in memory first, from the pinned base
texts (the tree's files peeled back to the base), then change the pinned
files and the manifest in one ``Transaction``, under the module directory's
lock. A write cut short by a kill is undone by the next `apply` or
`apply --revert` before it does anything else; a manifest that is missing,
unreadable or out of date is rewritten whenever the bytes are a known state.
An empty series is the pinned base: applying it reverts (no manifest left).
The module directory is resolved once, and a symlinked one is reported.
"""

from __future__ import annotations

import msgspec

from vllm_overlay import __version__
from vllm_overlay.errors import OverlayError
from vllm_overlay.safefile import UnsafeFileError, lstat
from vllm_overlay.series.diff import HunkError, apply_file_patch
from vllm_overlay.series.patch_series import Series
from vllm_overlay.series.pin import Pin, sha256_bytes
from vllm_overlay.transaction import Change, Transaction, TransactionError, lock
from vllm_overlay.tree.manifest import (
    MANIFEST_NAME,
    AppliedPatch,
    Manifest,
    ManifestFile,
    encode_manifest,
)
from vllm_overlay.tree.status import StatusReport, read_pinned, tree_status
from vllm_overlay.tree.target import Target


class ApplyError(OverlayError):
    """The series cannot be applied or reverted; the target is unchanged."""


class ApplyReport(msgspec.Struct):
    """What `apply` (or `apply --revert`) did, for people and ``--json``."""

    action: str  # "applied", "reverted", "repaired", "no-op"
    message: str
    files: list[str]  # pinned paths written
    series_id: str = ""
    recovered: list[str] = []  # what was undone or cleaned up first
    warnings: list[str] = []


def overlay_texts(bases: dict[str, str], series: Series) -> dict[str, str]:
    """The overlaid text of every file the series touches, from base texts."""
    out: dict[str, str] = {}
    for path in series.touched_paths():
        if path not in bases:
            raise ApplyError(f"the series touches {path}, which is not pinned")
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
    bad = [f for f in report.files if f.pinned and f.state in ("unknown", "missing")]
    if not bad:
        return
    f = bad[0]
    if f.state == "missing":
        raise ApplyError(f"{f.path}: missing from the target; nothing was written")
    if not f.actual_sha256:  # a symlink, or over the size cap: not read
        raise ApplyError(f"{f.path}: {f.detail}; nothing was written")
    why = f" ({f.detail})" if f.detail else ""
    raise ApplyError(
        f"{f.path}: does not match the pinned base{why} (expected sha256 "
        f"{f.expected_sha256}, actual {f.actual_sha256}); nothing was written"
    )


def _warnings(report: StatusReport) -> list[str]:
    return [
        f"{f.path}: not in the pin; left as it is" for f in report.files if not f.pinned
    ]


def _manifest(pin: Pin, series: Series, texts: dict[str, str]) -> bytes:
    return encode_manifest(
        Manifest(
            tool_version=__version__,
            series_id=series.series_id,
            vllm_version=pin.vllm.version,
            vllm_git_commit=pin.vllm.git_commit,
            patches=[AppliedPatch(p.name, p.text) for p in series.patches],
            files={
                path: ManifestFile(pin.files[path], sha256_bytes(text.encode()))
                for path, text in texts.items()
            },
        )
    )


def _rel(pin: Pin, path: str) -> str:
    return path[len(pin.module.rstrip("/")) + 1 :]


def apply_series(
    target: Target, pin: Pin, series: Series, *, wait: bool = False
) -> ApplyReport:
    """Bring the tree to exactly the base with the series, with its manifest."""
    return _change(target, pin, series, overlay=True, wait=wait)


def revert_series(
    target: Target, pin: Pin, series: Series, *, wait: bool = False
) -> ApplyReport:
    """Bring the tree to exactly the pinned base, without a manifest."""
    return _change(target, pin, series, overlay=False, wait=wait)


def _change(
    target: Target, pin: Pin, series: Series, *, overlay: bool, wait: bool
) -> ApplyReport:
    try:
        return _locked_change(target, pin, series, overlay=overlay, wait=wait)
    except TransactionError as e:
        raise ApplyError(str(e)) from None
    except UnsafeFileError as e:  # a pinned file swapped after status read it
        raise ApplyError(f"{e}; nothing was written") from None


def _locked_change(
    target: Target, pin: Pin, series: Series, *, overlay: bool, wait: bool
) -> ApplyReport:
    # The module directory is resolved once: every read and write below
    # goes there, even if a symlink on the way is changed meanwhile.
    target = target.resolve_module()
    module_dir = target.module_dir()
    notes = []
    if module_dir != target.root / pin.module:
        notes.append(
            f"{target.root / pin.module} resolves to {module_dir} through a "
            "symlink: the files there are the ones changed"
        )
    empty = overlay and not series.patches
    overlay = overlay and not empty  # an empty series is the pinned base
    with lock(module_dir, wait=wait):
        txn = Transaction(module_dir, dirs={target.file(p).parent for p in pin.files})
        recovered = txn.recover()
        report, bases = tree_status(target, pin, series)
        _refuse_unless_known(report)
        desired = {path: bases[path] for path in pin.files}
        if overlay:
            desired.update(overlay_texts(bases, series))
        changes = {
            _rel(pin, path): Change(text.encode())
            for path, text in sorted(desired.items())
            if read_pinned(target.file(path)) != text.encode()
        }
        manifest_ok = report.manifest in ("ok", "absent")
        if overlay and (changes or not manifest_ok):
            touched = {p: desired[p] for p in series.touched_paths()}
            changes[MANIFEST_NAME] = Change(_manifest(pin, series, touched))
        elif not overlay and lstat(module_dir / MANIFEST_NAME) is not None:
            changes[MANIFEST_NAME] = Change(None)
        txn.commit(changes)
    written = sorted(path for path in desired if _rel(pin, path) in changes)
    message = _message(overlay, report, series, written, changes)
    if empty:
        message = f"the series is empty: {message}"
    return ApplyReport(
        action=_action(overlay, report, written, changes),
        message=message,
        files=written,
        series_id=series.series_id if overlay else "",
        recovered=recovered,
        warnings=notes + _warnings(report),
    )


def _action(
    overlay: bool, report: StatusReport, written: list[str], changes: dict[str, Change]
) -> str:
    if written:
        return "applied" if overlay else "reverted"
    return "repaired" if changes else "no-op"


def _message(
    overlay: bool,
    report: StatusReport,
    series: Series,
    written: list[str],
    changes: dict[str, Change],
) -> str:
    sid = series.series_id
    if not overlay:
        if written:
            return "restored the pinned base"
        if changes:
            return "already the pinned base; removed the manifest"
        return "already the pinned base"
    if written:
        verb = {
            "stale": "re-applied over a stale overlay",
            "partial": "completed a partial overlay",
        }.get(report.state, "applied")
        return f"{verb}: {len(series.patches)} patches (series {sid})"
    if changes:
        return (
            f"the files were already overlaid with series {sid}; rewrote the "
            f"manifest (it was {report.manifest.split(':')[0]})"
        )
    return f"already overlaid with series {sid}"
