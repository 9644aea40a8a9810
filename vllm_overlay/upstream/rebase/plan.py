"""The series walked patch by patch over the old and the new base, and what
``--write`` writes: the new pin, the refreshed patches, the series.

A patch that landed upstream in another form (``anotherform``) is set aside
on the new base (its hand-refreshed remainder is carried instead when one is
given), so the patches above are still assessed, each saying what it was
assessed without."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.series.diff import (
    FilePatch,
    HunkError,
    apply_file_patch,
    format_file_patch,
    git_blob_sha1,
    parse_patch,
    place_hunks,
    shift_hunk_headers,
)
from vllm_overlay.series.patch_series import (
    DROPPED_DIR,
    DROPPED_SUFFIX,
    PATCH_DIR,
    SERIES_FILE,
    Series,
    SeriesPatch,
    dropped_record,
    put_header_field,
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
from vllm_overlay.tree.apply import ApplyError, overlay_texts
from vllm_overlay.upstream.rebase import anotherform
from vllm_overlay.upstream.rebase.classify import (
    FileInput,
    FileOutcome,
    classify_patch,
    combine,
)
from vllm_overlay.upstream.rebase.newbase import NewBase
from vllm_overlay.upstream.rebase.refreshed import Carried, carry
from vllm_overlay.upstream.rebase.report import (
    RebaseError,
    RebaseReport,
    RebaseRow,
)

DEFAULT_WORKDIR = Path("dist/rebase")


@dataclass
class Plan:
    """What `--write` would write: the new pin and the new patch texts."""

    pin: Pin
    patches: dict[str, str | None] = field(default_factory=dict)  # None: drop
    # The record of each dropped patch: file name in patches/dropped -> text.
    dropped: dict[str, str] = field(default_factory=dict)


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
    version: str  # what Applied-Upstream names: the new base's version
    blocked: dict[str, str] = field(default_factory=dict)  # path -> patch
    refreshed: dict[str, str | None] = field(default_factory=dict)  # None: drop
    dropped: dict[str, str] = field(default_factory=dict)  # record -> text
    # Hand-refreshed versions to use in a patch's place (--refreshed).
    given: dict[str, SeriesPatch] = field(default_factory=dict)
    # Patches landed in another form, left out of the new chain: their paths.
    set_aside: dict[str, set[str]] = field(default_factory=dict)


def applied_version(new: NewBase) -> str:
    """What Applied-Upstream names for this new base: its version, else its
    git commit, else where it came from."""
    return new.version or (f"git {new.git_commit}" if new.git_commit else new.source)


def carries_series(old_bases: dict[str, str], series: Series, new: NewBase) -> bool:
    """Whether the new base is the pinned base with this whole series
    applied (an overlaid install): every pinned file as the overlay writes
    it."""
    try:
        overlaid = {**old_bases, **overlay_texts(old_bases, series)}
    except ApplyError:
        return False
    return bool(series.patches) and all(
        new.text(path) == text for path, text in overlaid.items()
    )


def rebase_plan(
    pin: Pin,
    series: Series,
    old_bases: dict[str, str],
    new: NewBase,
    workdir: Path,
    *,
    git_commit: str = "",
    given: dict[str, SeriesPatch] | None = None,
) -> tuple[RebaseReport, Plan | None]:
    """Classify every patch; the plan is None unless all apply or are
    upstream (a patch landed in another form counts only with its
    hand-refreshed remainder in ``given``)."""
    walk = _Walk(
        old=dict(old_bases),
        new={p: d.decode() for p, d in new.files.items()},
        labels=(f"new base {new.version}", f"old base {pin.vllm.version}"),
        workdir=workdir,
        version=applied_version(new),
        given=dict(given or {}),
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
    return report, Plan(new_pin(pin, new, git_commit), walk.refreshed, walk.dropped)


def _step(walk: _Walk, patch: SeriesPatch) -> RebaseRow:
    """Classify one patch and carry it (or what did not land, or its
    hand-refreshed version) forward on the new base."""
    row = _classify_step(walk, patch)
    paths = {fp.path for fp in patch.files}
    row.set_aside = [
        n for n, ps in walk.set_aside.items() if ps & paths and n != patch.name
    ]
    return row


def _classify_step(walk: _Walk, patch: SeriesPatch) -> RebaseRow:
    outcomes = _assess(walk, patch)
    result, detail = combine(outcomes)
    hunks = [h for o in outcomes for h in o.hunks]
    merged = [m for o in outcomes for m in o.merged]
    conflicts = [c for o in outcomes for c in o.conflicts]
    given = walk.given.get(patch.name)
    if result == "conflict" and anotherform.landed_in_another_form(
        s for o in outcomes for s in o.states.values()
    ):
        landed_as = anotherform.upstream_change(patch.header)
        per_file = {
            fp.path.rsplit("/", 1)[-1]: o.states
            for fp, o in zip(patch.files, outcomes, strict=True)
        }
        detail = (
            "landed in another form"
            + (f" as upstream {landed_as}" if landed_as else "")
            + ": "
            + anotherform.evidence(per_file)
        )
        row = RebaseRow(
            patch.name,
            "partly upstream",
            detail,
            hunks,
            merged,
            conflicts,
            landed_as=landed_as,
        )
        if given is None:
            walk.set_aside[patch.name] = {fp.path for fp in patch.files}
            row.hand = anotherform.hand_line(patch.name, walk.version)
            return row
        return _carry_given(walk, given, row)
    if given is not None and result != "blocked":
        raise RebaseError(
            f"--refreshed {given.path}: {patch.name} did not land upstream in "
            f"another form on this base (it is {result}); a hand-refreshed "
            "version replaces only such a patch"
        )
    if result == "offset":
        detail = "; ".join(
            f"{h.file.rsplit('/', 1)[-1]} hunk #{h.hunk} "
            f"{h.offset:+d} lines ({h.header})"
            for h in hunks
        )
    head, _ = split_header(patch.text, patch.name)
    if result in ("conflict", "blocked"):
        for fp in patch.files:
            walk.blocked.setdefault(fp.path, patch.name)
    elif result == "upstream":
        walk.refreshed[patch.name] = None
        record = patch.slug + DROPPED_SUFFIX
        walk.dropped[record] = dropped_record(head, walk.version)
    else:
        if result == "partly upstream":
            head = put_header_field(
                head, "Applied-Upstream", f"{walk.version} (in part)"
            )
        walk.refreshed[patch.name] = _refresh(patch, head, outcomes, walk.new)
        for fp, o in zip(patch.files, outcomes, strict=True):
            if o.new_post is not None:
                walk.new[fp.path] = o.new_post
    return RebaseRow(patch.name, result, detail, hunks, merged, conflicts)


def _carry_given(walk: _Walk, given: SeriesPatch, row: RebaseRow) -> RebaseRow:
    """A patch landed in another form, carried as its hand-refreshed
    remainder: refreshed for the new chain when it applies there; else a
    conflict in the files it touches."""
    done = carry(given, walk.new)
    row.refreshed = str(given.path)
    if done.result == "conflict":
        for fp in given.files:
            walk.blocked.setdefault(fp.path, row.patch)
        failed = "; ".join(
            f"{n.file.rsplit('/', 1)[-1]} hunk #{n.hunk}: {n.problem}"
            for n in done.failed
        )
        row.result = "conflict"
        row.detail = (
            f"its hand-refreshed remainder {given.path} does not apply to the new "
            f"base ({failed}); {row.detail}"
        )
        return row
    head, _ = split_header(given.text, given.name)
    walk.refreshed[row.patch] = _refresh(
        given, head, _carried_outcomes(given, done), walk.new
    )
    walk.new.update(done.posts)
    how = "applies" if done.result == "clean" else "applies with offsets"
    row.detail = (
        f"carried as its hand-refreshed remainder {given.path} ({how}); " + row.detail
    )
    return row


def _carried_outcomes(given: SeriesPatch, done: Carried) -> list[FileOutcome]:
    return [
        FileOutcome(
            done.result,
            "",
            done.posts[fp.path],
            kept=list(range(len(fp.hunks))),
            offsets=done.offsets[fp.path],
        )
        for fp in given.files
    ]


def _assess(walk: _Walk, patch: SeriesPatch) -> list[FileOutcome]:
    """Each file of ``patch`` against the new base (or blocked there)."""
    inputs: list[FileInput] = []
    for fp in patch.files:
        old_pre = walk.old[fp.path]
        try:
            old_post = apply_file_patch(old_pre, fp).text
        except HunkError as e:
            raise RebaseError(
                f"{patch.name} does not apply to the pinned base ({e}); "
                "fix the series first (`vllm-overlay series check`, `apply`)"
            ) from None
        blocked_by = walk.blocked.get(fp.path, "")
        inputs.append(
            FileInput(fp, old_pre, old_post, walk.new.get(fp.path), blocked_by)
        )
    outcomes = classify_patch(patch, inputs, walk.labels, walk.workdir)
    walk.old.update({i.fp.path: i.old_post for i in inputs})
    return outcomes


def _index_modes(body: str) -> dict[str, str]:
    """What follows ``index a..b`` (the mode) for each file of a diff."""
    modes: dict[str, str] = {}
    current = None
    for line in body.splitlines():
        if line.startswith("diff --git "):
            current = line.rsplit(" b/", 1)[-1]
        m = _INDEX_RE.match(line)
        if m and current is not None:
            modes[current] = m.group(3)
    return modes


def _refresh(
    patch: SeriesPatch,
    head: str,
    outcomes: list[FileOutcome],
    new_chain: dict[str, str],
) -> str:
    """The patch as it applies exactly to the new base: every hunk kept,
    its ``@@`` lines moved; or, when some landed, the hunks that did not,
    rendered anew (a file of which nothing is left goes)."""
    old_head, body = split_header(patch.text, patch.name)
    pairs = [(fp, o) for fp, o in zip(patch.files, outcomes, strict=True) if o.kept]
    blobs = {
        fp.path: (
            git_blob_sha1(new_chain[fp.path].encode()),
            git_blob_sha1((o.new_post or "").encode()),
        )
        for fp, o in pairs
    }
    whole = len(pairs) == len(patch.files) and all(
        len(o.kept) == len(fp.hunks) for fp, o in pairs
    )
    if whole:
        shifts = {fp.path: o.offsets for fp, o in pairs}
        new_body = refresh_index_lines(shift_hunk_headers(body, shifts), blobs)
    else:
        modes = _index_modes(body)
        new_body = "".join(
            format_file_patch(
                FilePatch(
                    fp.old_path,
                    fp.new_path,
                    place_hunks([fp.hunks[k] for k in o.kept], o.offsets),
                ),
                f"index {blobs[fp.path][0][:7]}..{blobs[fp.path][1][:7]}"
                + modes.get(fp.path, " 100644"),
            )
            for fp, o in pairs
        )
    # The refreshed patch must apply exactly, giving what the offsets gave.
    for fp, (_, o) in zip(parse_patch(new_body), pairs, strict=True):
        if apply_file_patch(new_chain[fp.path], fp).text != o.new_post:
            raise RebaseError(f"{patch.name}: refreshing {fp.path} went wrong")
    sep = patch.text[len(old_head) :].split("\n", 1)[0] + "\n"
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
        # The core series is against the new base's core files too.
        core_files={p: sha256_bytes(d) for p, d in sorted(new.core_files.items())},
    )


def write_plan(root: Path, plan: Plan) -> list[Path]:
    """Write the new pin, the refreshed patches, the series and the records
    of dropped patches in one transaction; returns the files changed. Every
    text is computed (and the pin validated) first."""
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
    for record, text in sorted(plan.dropped.items()):
        changes[f"{PATCH_DIR}/{DROPPED_DIR}/{record}"] = Change(text.encode())
    dirs = [patch_dir]
    if plan.dropped:
        dirs.append(patch_dir / DROPPED_DIR)
    transaction = Transaction(root, dirs=dirs)
    with lock(root, what="rebase"):
        transaction.recover()
        for d in dirs:
            d.mkdir(exist_ok=True)
        transaction.commit(changes)
    return [root / rel for rel in changes]
