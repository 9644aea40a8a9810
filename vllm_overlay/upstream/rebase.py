"""`vllm-overlay rebase`: move the series onto a newer vLLM base.

Each patch, in series order, is classified against the new base:

- ``clean``: applies exactly where its hunks say;
- ``offset``: applies, every line identical, but some hunks moved (named,
  with their offsets);
- ``upstream``: the new base already holds the change: the patch
  reverse-applies to it (offsets allowed), or a 3-way merge of the patch into
  the new base changes nothing. Proposed for removal; never reverse-applied;
- ``conflict``: neither. A 3-way merge (``git merge-file``: new base, old
  base, old base with the patch) is written with conflict markers to the work
  directory, with its three inputs, and the hunks that no longer apply are
  named. A patch that is upstream in one file but not in another is a
  conflict too ("partly upstream");
- ``blocked``: not assessed, because an earlier patch conflicts in a file it
  touches (its starting text on the new base is unknown).

The chain on the new base carries clean/offset patches forward and skips
upstream ones. Only when no patch conflicts or is blocked, and with
``--write``, the pin (new version, hashes, wheel) and the refreshed patches
(hunk headers and ``index`` lines recomputed against the new base; the hunk
bodies are unchanged) are written, and upstream patches are dropped from the
series. Otherwise the repository is left untouched and the exit status is 1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.series.diff import (
    FilePatch,
    Hunk,
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
    sha256_file,
)
from vllm_overlay.tree.target import detect_target

Result = Literal["clean", "offset", "upstream", "conflict", "blocked"]
DEFAULT_WORKDIR = Path("dist/rebase")
DEFAULT_CACHE = Path.home() / ".cache" / "vllm-overlay" / "wheels"
_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+\S*$")


class RebaseError(OverlayError):
    """The new base cannot be obtained or the result cannot be written."""


class HunkNote(msgspec.Struct, forbid_unknown_fields=True):
    file: str
    hunk: int  # 1-based, in the patch's order for that file
    header: str
    offset: int = 0
    problem: str = ""


class RebaseRow(msgspec.Struct, forbid_unknown_fields=True):
    patch: str
    result: Result
    detail: str
    hunks: list[HunkNote] = []
    # Files written to the work directory (conflicts): merged results.
    merged: list[str] = []


class RebaseReport(msgspec.Struct, forbid_unknown_fields=True):
    from_version: str
    to_version: str
    to_source: str
    series_id: str
    workdir: str
    rows: list[RebaseRow]
    written: bool = False

    @property
    def ok(self) -> bool:
        return all(r.result in ("clean", "offset", "upstream") for r in self.rows)


@dataclass(frozen=True)
class NewBase:
    """The module files of the base to rebase onto, and where they came from."""

    source: str
    version: str
    git_commit: str  # "" when the source does not record it
    wheel: str  # "" for a source tree
    wheel_sha256: str
    files: dict[str, bytes]

    def text(self, path: str) -> str | None:
        data = self.files.get(path)
        return None if data is None else data.decode()


@dataclass
class Plan:
    """What `--write` would write: the new pin and the new patch texts."""

    pin: Pin
    patches: dict[str, str | None] = field(default_factory=dict)  # None: drop


# --------------------------------------------------------------------------
# The new base
# --------------------------------------------------------------------------


def _version_info(text: str) -> tuple[str, str]:
    """(version, git commit) from a vLLM ``_version.py``; "" when absent."""
    version = re.search(r"^__version__ = version = '([^']+)'", text, re.M)
    commit = re.search(r"^__commit_id__ = commit_id = '(?:g)?([0-9a-f]+)'", text, re.M)
    return (version.group(1) if version else "", commit.group(1) if commit else "")


def new_base_from_wheel(wheel: Path, module: str) -> NewBase:
    prefix = module.rstrip("/") + "/"
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise RebaseError(f"{wheel}: not a readable wheel: {e}") from None
    with zf:
        names = [
            n
            for n in zf.namelist()
            if n.startswith(prefix) and not n.endswith("/") and "__pycache__" not in n
        ]
        if not names:
            raise RebaseError(f"{wheel}: holds no {module}")
        files = {n: zf.read(n) for n in sorted(names)}
        try:
            version_py = zf.read("vllm/_version.py").decode()
        except KeyError:
            version_py = ""
    version, commit = _version_info(version_py)
    if not version:
        version = wheel.name.split("-")[1]
    return NewBase(
        source=f"wheel {wheel}",
        version=version,
        git_commit=commit,
        wheel=wheel.name,
        wheel_sha256=sha256_file(wheel),
        files=files,
    )


def new_base_from_source(path: Path, module: str) -> NewBase:
    target = detect_target(path)
    base = target.root / module
    if not base.is_dir():
        raise RebaseError(f"{target.describe()}: has no {module}")
    files = {
        p.relative_to(target.root).as_posix(): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
    }
    version_py = target.root / "vllm" / "_version.py"
    version, commit = _version_info(
        version_py.read_text() if version_py.is_file() else ""
    )
    if (target.root / ".git").exists():
        head = subprocess.run(
            ["git", "-C", str(target.root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
        )
        if head.returncode == 0:
            commit = head.stdout.strip()
    return NewBase(
        source=target.describe(),
        version=version,
        git_commit=commit,
        wheel="",
        wheel_sha256="",
        files=files,
    )


def fetch_version(version: str, cache: Path) -> Path:
    """The wheel of vLLM ``version`` in ``cache``, downloaded by pip when
    missing (pip's own cache avoids a second download)."""
    dest = cache / f"vllm-{version}"
    found = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if not found:
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            f"vllm=={version}",
            "-d",
            str(dest),
        ]
        print(f"rebase: {' '.join(cmd)}", flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            tail = (run.stderr or run.stdout).strip().splitlines()[-1:]
            why = " ".join(tail) or f"exit {run.returncode}"
            raise RebaseError(f"pip download vllm=={version} failed: {why}")
        found = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if len(found) != 1:
        raise RebaseError(f"{dest}: expected one vllm-{version} wheel, found {found}")
    return found[0]


def resolve_new_base(spec: str, module: str, cache: Path) -> NewBase:
    path = Path(spec)
    if path.suffix == ".whl":
        if not path.is_file():
            raise RebaseError(f"{spec}: no such wheel")
        return new_base_from_wheel(path, module)
    if path.is_dir():
        return new_base_from_source(path, module)
    if _VERSION_RE.match(spec):
        return new_base_from_wheel(fetch_version(spec, cache), module)
    raise RebaseError(f"--to {spec!r}: neither a wheel, a directory nor a version")


# --------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------


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
        return FileOutcome("upstream", f"{_name(fp)}: the patch reverse-applies")
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
            "upstream", f"{_name(fp)}: a 3-way merge of the patch changes nothing"
        )
    out = workdir / patch.slug
    out.mkdir(parents=True, exist_ok=True)
    stem = _name(fp)
    written = []
    for suffix, text in (
        ("merged", merge.text),
        ("new-base", new_pre),
        ("old-base", old_pre),
        ("old-patched", old_post),
    ):
        dest = out / f"{stem}.{suffix}"
        dest.write_text(text)
        written.append(str(dest))
    markers = [
        i
        for i, line in enumerate(merge.text.splitlines(), 1)
        if line.startswith("<<<<<<< ")
    ]
    failed = _failed_hunks(fp, new_pre)
    names = ", ".join(f"#{n.hunk} {n.header}" for n in failed) or "none alone"
    if merge.conflicts:
        where = ", ".join(map(str, markers[:8])) + (" ..." if len(markers) > 8 else "")
        detail = (
            f"{stem}: {merge.conflicts} conflict(s) at merged lines {where}; "
            f"hunks not applying: {names}; see {written[0]}"
        )
    else:
        detail = (
            f"{stem}: context changed (hunks {names}); the 3-way merge is clean "
            f"but needs review: {written[0]}"
        )
    return FileOutcome("conflict", detail, hunks=failed, merged=written[:1])


def _name(fp: FilePatch) -> str:
    return fp.path.rsplit("/", 1)[-1]


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


def _combine(outcomes: list[FileOutcome]) -> tuple[Result, str]:
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
    old_chain = dict(old_bases)
    new_chain = {p: d.decode() for p, d in new.files.items()}
    blocked: dict[str, str] = {}  # path -> the patch that conflicts there
    rows: list[RebaseRow] = []
    refreshed: dict[str, str | None] = {}
    labels = (f"new base {new.version}", f"old base {pin.vllm.version}")
    for patch in series.patches:
        outcomes: list[FileOutcome] = []
        posts: dict[str, str] = {}
        for fp in patch.files:
            old_pre = old_chain[fp.path]
            try:
                old_post = apply_file_patch(old_pre, fp).text
            except HunkError as e:
                raise RebaseError(
                    f"{patch.name} does not apply to the pinned base ({e}); "
                    "fix the series first (`vllm-overlay series check`, `apply`)"
                ) from None
            posts[fp.path] = old_post
            if fp.path in blocked:
                outcomes.append(
                    FileOutcome(
                        "blocked",
                        f"{_name(fp)}: not assessed, {blocked[fp.path]} "
                        "conflicts there",
                    )
                )
                continue
            outcomes.append(
                classify_file(
                    patch,
                    fp,
                    old_pre,
                    old_post,
                    new_chain.get(fp.path),
                    labels,
                    workdir,
                )
            )
        old_chain.update(posts)
        result, detail = _combine(outcomes)
        hunks = [h for o in outcomes for h in o.hunks]
        if result == "offset":
            detail = "; ".join(
                f"{h.file.rsplit('/', 1)[-1]} hunk #{h.hunk} "
                f"{h.offset:+d} lines ({h.header})"
                for h in hunks
            )
        if result in ("conflict", "blocked"):
            for fp in patch.files:
                blocked.setdefault(fp.path, patch.name)
        elif result == "upstream":
            refreshed[patch.name] = None
        else:
            refreshed[patch.name] = _refresh(patch, outcomes, new_chain)
            for fp, o in zip(patch.files, outcomes, strict=True):
                assert o.new_post is not None
                new_chain[fp.path] = o.new_post
        rows.append(
            RebaseRow(
                patch.name,
                result,
                detail,
                hunks,
                [m for o in outcomes for m in o.merged],
            )
        )
    report = RebaseReport(
        from_version=pin.vllm.version,
        to_version=new.version,
        to_source=new.source,
        series_id=series.series_id,
        workdir=str(workdir),
        rows=rows,
    )
    if not report.ok:
        return report, None
    return report, Plan(new_pin(pin, new, git_commit), refreshed)


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


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def format_table(report: RebaseReport) -> str:
    rows = [("patch", "result", "detail")] + [
        (r.patch, r.result, r.detail or "-") for r in report.rows
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [
        f"rebase: {report.from_version} -> {report.to_version} ({report.to_source})"
    ]
    lines += [f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def encode_report(report: RebaseReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"


def write_plan(root: Path, plan: Plan) -> list[Path]:
    """Write the new pin, the refreshed patches and the series; returns the
    files changed. Every text is computed (and the pin validated) first."""
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
    series_lines = [
        line
        for line in series_path.read_text().splitlines(keepends=True)
        if line.split("#", 1)[0].strip() not in dropped
    ]
    writes: dict[Path, str] = {root / PIN_FILE: pin_text}
    for name, text in plan.patches.items():
        path = patch_dir / name
        if text is not None and path.read_text() != text:
            writes[path] = text
    if dropped:
        writes[series_path] = "".join(series_lines)
    temps = []
    for path, text in writes.items():
        tmp = path.with_name(f".{path.name}.rebase-tmp")
        tmp.write_text(text)
        temps.append((tmp, path))
    for tmp, path in temps:
        os.replace(tmp, path)
    changed = [path for _, path in temps]
    for name in sorted(dropped):
        (patch_dir / name).unlink()
        changed.append(patch_dir / name)
    return changed
