"""``--series-ref REF``: the series (pin.toml and patches/) as a git ref of
the checkout has it, read with ``git show`` into a directory of its own.

A fresh ``git clone`` of this repository has every tag and, for each branch
of the origin, ``origin/<branch>``: the 0.33.0 series is the tag
``series-0.33.0`` (fixed) or ``origin/release/0.33`` (the branch, moving
with its fixes); a bare ``release/0.33`` resolves only once that branch is
checked out locally. A shallow clone (``--depth``) has no tags.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from vllm_overlay.series.patch_series import PATCH_DIR
from vllm_overlay.series.pin import PIN_FILE
from vllm_overlay.upstream.rebase.report import RebaseError

REFS_HINT = "a fresh clone has the tag series-0.33.0 and the branch origin/release/0.33"


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True)


def resolve(root: Path, ref: str) -> str:
    """The commit ``ref`` names in the checkout at ``root``."""
    if ref.startswith("-"):
        raise RebaseError(f"--series-ref {ref}: not a git ref")
    run = _git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if run.returncode != 0:
        raise RebaseError(f"--series-ref {ref}: no such commit in {root} ({REFS_HINT})")
    return run.stdout.decode().strip()


def export_series(root: Path, ref: str, dest: Path) -> str:
    """Write ``pin.toml`` and ``patches/`` as ``ref`` has them into
    ``dest`` (an empty directory); returns the commit."""
    commit = resolve(root, ref)
    listed = _git(root, "ls-tree", "-r", "-z", "--name-only", commit, "--", PATCH_DIR)
    names = [n for n in listed.stdout.decode().split("\0") if n]
    if listed.returncode != 0 or not names:
        raise RebaseError(f"--series-ref {ref}: {commit[:9]} has no {PATCH_DIR}/")
    for rel in [PIN_FILE, *names]:
        shown = _git(root, "show", f"{commit}:{rel}")
        if shown.returncode != 0:
            raise RebaseError(f"--series-ref {ref}: {commit[:9]} has no {rel}")
        out = dest / rel
        if not out.resolve().is_relative_to(dest.resolve()):
            raise RebaseError(f"--series-ref {ref}: {rel} lies outside the series")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(shown.stdout)
    return commit
