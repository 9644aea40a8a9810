"""The series walked patch by patch over the old and the new base, and what
``--write`` writes: the new pin, the refreshed patches, the series."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.series.diff import (
    HunkError,
    apply_file_patch,
    git_blob_sha1,
    parse_patch,
    shift_hunk_headers,
)
from vllm_overlay.series.patch_series import (
    PATCH_DIR,
    SERIES_FILE,
    Series,
    SeriesPatch,
    split_header,
)
from vllm_overlay.series.pin import (
    PIN_FILE,
    ImageRef,
    Pin,
    PinError,
    VllmBase,
    decode_pin,
    encode_pin,
    sha256_bytes,
)
from vllm_overlay.transaction import Change, Transaction, lock
from vllm_overlay.upstream.rebase.classify import (
    FileOutcome,
    classify_file,
    combine,
    file_name,
)
from vllm_overlay.upstream.rebase.newbase import NewBase
from vllm_overlay.upstream.rebase.report import RebaseError, RebaseReport, RebaseRow

DEFAULT_WORKDIR = Path("dist/rebase")


@dataclass
class Plan:
    """What `--write` would write: the new pin and the new patch texts."""

    pin: Pin
    patches: dict[str, str | None] = field(default_factory=dict)  # None: drop


_INDEX_RE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(.*)$")


def refresh_index_lines(text: str, blobs: dict[str, tuple[str, str]]) -> str:
    """``index a..b`` lines recomputed from the texts before and after the
    patch (``blobs[path]``), same abbreviation length."""
    out = []
    current = None
    for line in text.splitlines(keepends=True):
        if line.startswith("diff --git "):
            current = line.rstrip("\n").rsplit(" b/", 1)[-1]
        m = _INDEX_RE.match(line.rstrip("\n"))
        if m and current in blobs:
            pre, post = blobs[current]
            n = len(m.group(1))
            line = f"index {pre[:n]}..{post[:n]}{m.group(3)}\n"
        out.append(line)
    return "".join(out)


@dataclass
class _Walk:
    """The series walked patch by patch over both bases."""

    old: dict[str, str]  # the pinned base with the patches so far
    new: dict[str, str]  # the new base with the patches carried so far
    labels: tuple[str, str]  # merge labels: the new base, the old base
    workdir: Path
    blocked: dict[str, str] = field(default_factory=dict)  # path -> patch
    refreshed: dict[str, str | None] = field(default_factory=dict)  # None: drop


def rebase_plan(
    pin: Pin,
    series: Series,
    old_bases: dict[str, str],
    new: NewBase,
    workdir: Path,
    *,
    git_commit: str = "",
) -> tuple[RebaseReport, Plan | None]:
    """Classify every patch; the plan is None unless all apply or are upstream."""
    walk = _Walk(
        old=dict(old_bases),
        new={p: d.decode() for p, d in new.files.items()},
        labels=(f"new base {new.version}", f"old base {pin.vllm.version}"),
        workdir=workdir,
    )
    report = RebaseReport(
        from_version=pin.vllm.version,
        to_version=new.version,
        to_source=new.source,
        series_id=series.series_id,
        workdir=str(workdir),
        rows=[_step(walk, patch) for patch in series.patches],
    )
    if not report.ok:
        return report, None
    return report, Plan(new_pin(pin, new, git_commit), walk.refreshed)


def _step(walk: _Walk, patch: SeriesPatch) -> RebaseRow:
    """Classify one patch and carry it forward on the new base."""
    outcomes = _assess(walk, patch)
    result, detail = combine(outcomes)
    hunks = [h for o in outcomes for h in o.hunks]
    if result == "offset":
        detail = "; ".join(
            f"{h.file.rsplit('/', 1)[-1]} hunk #{h.hunk} "
            f"{h.offset:+d} lines ({h.header})"
            for h in hunks
        )
    if result in ("conflict", "blocked"):
        for fp in patch.files:
            walk.blocked.setdefault(fp.path, patch.name)
    elif result == "upstream":
        walk.refreshed[patch.name] = None
    else:
        walk.refreshed[patch.name] = _refresh(patch, outcomes, walk.new)
        for fp, o in zip(patch.files, outcomes, strict=True):
            assert o.new_post is not None
            walk.new[fp.path] = o.new_post
    merged = [m for o in outcomes for m in o.merged]
    conflicts = [c for o in outcomes for c in o.conflicts]
    return RebaseRow(patch.name, result, detail, hunks, merged, conflicts)


def _assess(walk: _Walk, patch: SeriesPatch) -> list[FileOutcome]:
    """Each file of ``patch`` against the new base (or blocked there)."""
    outcomes: list[FileOutcome] = []
    posts: dict[str, str] = {}
    for fp in patch.files:
        old_pre = walk.old[fp.path]
        try:
            old_post = apply_file_patch(old_pre, fp).text
        except HunkError as e:
            raise RebaseError(
                f"{patch.name} does not apply to the pinned base ({e}); "
                "fix the series first (`vllm-overlay series check`, `apply`)"
            ) from None
        posts[fp.path] = old_post
        if fp.path in walk.blocked:
            culprit = walk.blocked[fp.path]
            why = f"{file_name(fp)}: not assessed, {culprit} conflicts there"
            outcomes.append(FileOutcome("blocked", why))
            continue
        new_pre = walk.new.get(fp.path)
        outcomes.append(
            classify_file(
                patch, fp, old_pre, old_post, new_pre, walk.labels, walk.workdir
            )
        )
    walk.old.update(posts)
    return outcomes


def _refresh(
    patch: SeriesPatch, outcomes: list[FileOutcome], new_chain: dict[str, str]
) -> str:
    head, body = split_header(patch.text, patch.name)
    shifts = {fp.path: o.offsets for fp, o in zip(patch.files, outcomes, strict=True)}
    blobs = {
        fp.path: (
            git_blob_sha1(new_chain[fp.path].encode()),
            git_blob_sha1((o.new_post or "").encode()),
        )
        for fp, o in zip(patch.files, outcomes, strict=True)
    }
    new_body = refresh_index_lines(shift_hunk_headers(body, shifts), blobs)
    # The refreshed patch must apply exactly, giving what the offsets gave.
    for fp, o in zip(parse_patch(new_body), outcomes, strict=True):
        if apply_file_patch(new_chain[fp.path], fp).text != o.new_post:
            raise RebaseError(f"{patch.name}: refreshing {fp.path} went wrong")
    sep = patch.text[len(head) :].split("\n", 1)[0] + "\n"
    return head + sep + new_body


def new_pin(pin: Pin, new: NewBase, git_commit: str = "") -> Pin:
    old_tag = f":v{pin.vllm.version}"
    image = pin.image
    if image.reference.endswith(old_tag) and new.version != pin.vllm.version:
        image = ImageRef(image.reference[: -len(old_tag)] + f":v{new.version}", "")
    return Pin(
        vllm=VllmBase(
            version=new.version,
            git_commit=git_commit or new.git_commit,
            wheel=new.wheel,
            wheel_sha256=new.wheel_sha256,
        ),
        image=image,
        module=pin.module,
        files={p: sha256_bytes(d) for p, d in sorted(new.files.items())},
    )


def write_plan(root: Path, plan: Plan) -> list[Path]:
    """Write the new pin, the refreshed patches and the series in one
    transaction; returns the files changed. Every text is computed (and the
    pin validated) first."""
    pin_text = encode_pin(plan.pin)
    try:
        decode_pin(pin_text, "the new pin")
    except PinError as e:
        raise RebaseError(
            f"{e}; nothing was written (a source tree records no wheel: "
            "rebase --to the wheel, or pass --git-commit when the base lacks one)"
        ) from None
    patch_dir = root / PATCH_DIR
    series_path = patch_dir / SERIES_FILE
    dropped = {name for name, text in plan.patches.items() if text is None}
    changes = {PIN_FILE: Change(pin_text.encode())}
    for name, text in plan.patches.items():
        path = patch_dir / name
        if text is not None and path.read_text() != text:
            changes[f"{PATCH_DIR}/{name}"] = Change(text.encode())
    if dropped:
        kept = [
            line
            for line in series_path.read_text().splitlines(keepends=True)
            if line.split("#", 1)[0].strip() not in dropped
        ]
        changes[f"{PATCH_DIR}/{SERIES_FILE}"] = Change("".join(kept).encode())
    for name in sorted(dropped):
        changes[f"{PATCH_DIR}/{name}"] = Change(None)
    transaction = Transaction(root, dirs=[patch_dir])
    with lock(root, what="rebase"):
        transaction.recover()
        transaction.commit(changes)
    return [root / rel for rel in changes]
