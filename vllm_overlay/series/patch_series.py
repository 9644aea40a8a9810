"""The patch series: `patches/series` and the DEP-3-style patch headers."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.series.diff import DiffError, FilePatch, parse_patch
from vllm_overlay.series.pin import Pin

PATCH_DIR = "patches"
SERIES_FILE = "series"
HEADER_END = "---"

# Header fields every patch must carry ("Applied-Upstream" may be empty).
REQUIRED_FIELDS = (
    "Subject",
    "Description",
    "Origin",
    "Author",
    "Forwarded",
    "Applied-Upstream",
    "Remove-When",
    "Tests",
)
OPTIONAL_FIELDS = ("Last-Update", "Reviewed-by", "Bug")
_FORWARDED_RE = re.compile(r"^(https?://\S+|not yet|no|not-needed)$")


class SeriesError(OverlayError):
    """The series or one of its patches is not usable."""


class PatchHeader(msgspec.Struct, forbid_unknown_fields=True):
    subject: str
    description: str
    origin: str
    author: str
    forwarded: str
    applied_upstream: str
    remove_when: str
    tests: list[str]
    last_update: str = ""
    reviewed_by: str = ""
    bug: str = ""

    @property
    def summary(self) -> str:
        """First line of the description."""
        return self.description.split("\n", 1)[0]


@dataclass(frozen=True)
class SeriesPatch:
    index: int  # 1-based position in the series
    name: str
    path: Path
    text: str
    header: PatchHeader
    files: tuple[FilePatch, ...]

    @property
    def slug(self) -> str:
        return self.name.removesuffix(".patch")

    def touches(self, path: str) -> bool:
        return any(f.path == path for f in self.files)


@dataclass(frozen=True)
class Series:
    root: Path
    patches: tuple[SeriesPatch, ...]

    @property
    def series_id(self) -> str:
        """Short content hash of the ordered series (names and bytes)."""
        h = hashlib.sha256()
        for p in self.patches:
            h.update(p.name.encode() + b"\0" + p.text.encode() + b"\0")
        return h.hexdigest()[:12]

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.patches]

    def touched_paths(self) -> list[str]:
        return sorted({f.path for p in self.patches for f in p.files})

    def patches_for(self, path: str) -> list[SeriesPatch]:
        return [p for p in self.patches if p.touches(path)]

    def upto(self, count: int) -> Series:
        return Series(self.root, self.patches[:count])


def read_series_file(patch_dir: Path) -> list[str]:
    series_path = patch_dir / SERIES_FILE
    try:
        raw = series_path.read_text()
    except OSError as e:
        raise SeriesError(f"{series_path}: cannot read: {e.strerror}") from None
    names = []
    for line in raw.splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            names.append(entry)
    return names


def split_header(text: str, name: str) -> tuple[str, str]:
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip("\r\n") == HEADER_END:
            return "".join(lines[:i]), "".join(lines[i + 1 :])
    raise SeriesError(f"{name}: no '{HEADER_END}' line between header and diff")


def parse_header(text: str, name: str) -> PatchHeader:
    fields: dict[str, list[str]] = {}
    current: str | None = None
    known = {f.lower(): f for f in (*REQUIRED_FIELDS, *OPTIONAL_FIELDS)}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            current = None
            continue
        if line[0] in " \t":
            if current is None:
                raise SeriesError(f"{name}:{lineno}: continuation line without a field")
            value = line.strip()
            fields[current].append("" if value == "." else value)
            continue
        key, sep, value = line.partition(":")
        canonical = known.get(key.strip().lower())
        if not sep or canonical is None:
            raise SeriesError(f"{name}:{lineno}: unknown header field {key.strip()!r}")
        if canonical in fields:
            raise SeriesError(f"{name}:{lineno}: field {canonical!r} given twice")
        current = canonical
        fields[canonical] = [value.strip()] if value.strip() else []
    missing = [f for f in REQUIRED_FIELDS if f not in fields]
    if missing:
        raise SeriesError(f"{name}: header lacks {', '.join(missing)}")
    empty = [f for f in REQUIRED_FIELDS if f != "Applied-Upstream" and not fields[f]]
    if empty:
        raise SeriesError(f"{name}: header field(s) empty: {', '.join(empty)}")
    forwarded = " ".join(fields["Forwarded"])
    if not _FORWARDED_RE.match(forwarded):
        raise SeriesError(
            f"{name}: Forwarded must be a URL or 'not yet', got {forwarded!r}"
        )
    tests = [t for v in fields["Tests"] for t in v.split()]
    return PatchHeader(
        subject=" ".join(fields["Subject"]),
        description="\n".join(fields["Description"]),
        origin=" ".join(fields["Origin"]),
        author=" ".join(fields["Author"]),
        forwarded=forwarded,
        applied_upstream=" ".join(fields["Applied-Upstream"]),
        remove_when=" ".join(fields["Remove-When"]),
        tests=tests,
        last_update=" ".join(fields.get("Last-Update", [])),
        reviewed_by=" ".join(fields.get("Reviewed-by", [])),
        bug=" ".join(fields.get("Bug", [])),
    )


def load_patch(path: Path, index: int) -> SeriesPatch:
    try:
        text = path.read_text()
    except OSError as e:
        raise SeriesError(f"{path.name}: cannot read: {e.strerror}") from None
    head, body = split_header(text, path.name)
    header = parse_header(head, path.name)
    try:
        files = tuple(parse_patch(body))
    except DiffError as e:
        raise SeriesError(f"{path.name}: not a unified diff: {e}") from None
    return SeriesPatch(index, path.name, path, text, header, files)


def load_series(root: Path) -> Series:
    """Load and parse every patch listed in ``root/patches/series``."""
    patch_dir = root / PATCH_DIR
    names = read_series_file(patch_dir)
    patches = []
    for i, name in enumerate(names, 1):
        path = patch_dir / name
        if not path.is_file():
            raise SeriesError(f"series lists {name}, but {path} does not exist")
        patches.append(load_patch(path, i))
    return Series(root, tuple(patches))


def check_series(root: Path, pin: Pin) -> list[str]:
    """Every problem of the series, one line each (empty: the series is sound)."""
    patch_dir = root / PATCH_DIR
    try:
        names = read_series_file(patch_dir)
    except SeriesError as e:
        return [str(e)]
    problems: list[str] = []
    seen: set[str] = set()
    for name in names:
        if name in seen:
            problems.append(f"series lists {name} more than once")
        seen.add(name)
        if "/" in name or not name.endswith(".patch"):
            problems.append(f"series entry {name!r} must be a .patch file in patches/")
    on_disk = {p.name for p in patch_dir.glob("*.patch")}
    for name in sorted(on_disk - seen):
        problems.append(f"{name} is in patches/ but not listed in the series")
    for i, name in enumerate(dict.fromkeys(names), 1):
        path = patch_dir / name
        if not path.is_file():
            problems.append(f"series lists {name}, but {path} does not exist")
            continue
        try:
            patch = load_patch(path, i)
        except SeriesError as e:
            problems.append(str(e))
            continue
        for fp in patch.files:
            if fp.path not in pin.files:
                problems.append(f"{name}: touches {fp.path}, which is not pinned")
        if not patch.header.tests:
            problems.append(f"{name}: Tests names no test")
        for test_id in patch.header.tests:
            test_file = test_id.split("::", 1)[0]
            if not (root / test_file).is_file():
                problems.append(
                    f"{name}: Tests names {test_id}, but {test_file} is missing"
                )
    return problems
