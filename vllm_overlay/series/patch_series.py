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
# Patches that left the series because upstream vLLM has them: each one's
# DEP-3 header, `Applied-Upstream` filled in, as `patches/dropped/<slug>.dep3`.
DROPPED_DIR = "dropped"
DROPPED_SUFFIX = ".dep3"

# DEP-3 fields (https://dep-team.pages.debian.net/deps/dep3/) this series
# uses, then the fields this project declares on top of DEP-3. README.md's
# "Patch headers" table lists the same fields; any other field is an error.
DEP3_FIELDS = (
    "Subject",
    "Description",
    "Origin",
    "Author",
    "Bug",
    "Forwarded",
    "Reviewed-by",
    "Applied-Upstream",
    "Last-Update",
)
PROJECT_FIELDS = ("Builds-On", "Remove-When", "Tests", "Guards")
# DEP-3's description field is "Description or Subject": exactly one of the
# two. Its first line is the short description (the upstream PR title), its
# continuation lines the long one (a Description needs them; DEP-3 expects a
# Subject's long description outside the fields, so a Subject may stand alone).
DESCRIPTION_FIELDS = ("Description", "Subject")
REQUIRED_FIELDS = (
    "Origin",
    "Author",
    "Forwarded",
    "Last-Update",
    "Remove-When",
    "Tests",
)
OPTIONAL_FIELDS = tuple(
    f for f in (*DEP3_FIELDS, *PROJECT_FIELDS) if f not in REQUIRED_FIELDS
)
# This project's own patches: their Author is this name with the address in
# patches/AUTHORS (`Name <email>`), which the mails use too.
PROJECT_NAME = "vllm-moriio-overlay"
AUTHORS_FILE = "AUTHORS"
_IDENTITY_RE = re.compile(r"^(.+?)\s*<([^<>@\s]+@[^<>\s]+)>$")
ORIGIN_CATEGORIES = ("upstream", "backport", "vendor", "other")
# Origins that name someone else's change: they must say where it lives.
UPSTREAM_ORIGINS = ("upstream", "backport")
_URL_RE = re.compile(r"^https?://\S+$")
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class SeriesError(OverlayError):
    """The series or one of its patches is not usable."""


class PatchHeader(msgspec.Struct, forbid_unknown_fields=True):
    subject: str  # Description's (or Subject's) first line: the PR title
    description: str  # its long description: a summary line, then paragraphs
    origin: str
    author: str
    forwarded: str
    applied_upstream: str
    remove_when: str
    tests: list[str]
    last_update: str = ""
    guards: list[str] = []
    builds_on: list[str] = []
    reviewed_by: str = ""
    bug: str = ""

    @property
    def summary(self) -> str:
        """First line of the description."""
        return self.description.split("\n", 1)[0]

    @property
    def origin_category(self) -> str:
        """``upstream``, ``backport``, ``vendor``, ``other``, or "" when the
        Origin is a bare URL."""
        head, sep, _ = self.origin.partition(",")
        return head.strip() if sep or head.strip() in ORIGIN_CATEGORIES else ""

    @property
    def origin_url(self) -> str:
        """The URL the Origin names, "" for none."""
        _, sep, rest = self.origin.partition(",")
        value = rest.strip() if sep else self.origin.strip()
        return value if _URL_RE.match(value) else ""

    @property
    def is_upstream(self) -> bool:
        """Someone else's pull request, carried until vLLM has it."""
        return self.origin_category in UPSTREAM_ORIGINS

    @property
    def forwarded_url(self) -> str:
        return self.forwarded if _URL_RE.match(self.forwarded) else ""

    @property
    def upstream_url(self) -> str:
        """Where upstream review of this change happens: the Forwarded URL,
        else an upstream Origin's URL."""
        return self.forwarded_url or (self.origin_url if self.is_upstream else "")


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


def _read_text(path: Path, name: str) -> str:
    """The file's text; unreadable or not UTF-8 is a ``SeriesError``."""
    try:
        return path.read_bytes().decode()
    except OSError as e:
        raise SeriesError(f"{name}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SeriesError(f"{name}: not UTF-8 text (byte {e.start})") from None


def read_series_file(patch_dir: Path) -> list[str]:
    series_path = patch_dir / SERIES_FILE
    raw = _read_text(series_path, str(series_path))
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


def _read_fields(text: str, name: str) -> tuple[dict[str, list[str]], list[str]]:
    """The header's fields (continuation lines joined, "." as an empty line)
    and the problems of its form."""
    fields: dict[str, list[str]] = {}
    problems: list[str] = []
    current: str | None = None
    known = {f.lower(): f for f in (*REQUIRED_FIELDS, *OPTIONAL_FIELDS)}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            current = None
            continue
        if line[0] in " \t":
            if current is None:
                problems.append(f"{name}:{lineno}: continuation line without a field")
            else:
                value = line.strip()
                fields[current].append("" if value == "." else value)
            continue
        key, sep, value = line.partition(":")
        canonical = known.get(key.strip().lower())
        current = None
        if not sep or canonical is None:
            problems.append(
                f"{name}:{lineno}: unknown header field {key.strip()!r} (neither "
                "DEP-3 nor declared in README.md's patch headers)"
            )
        elif canonical in fields:
            problems.append(f"{name}:{lineno}: field {canonical!r} given twice")
        else:
            current = canonical
            fields[canonical] = [value.strip()] if value.strip() else []
    return fields, problems


def _origin_problem(origin: str) -> str | None:
    head, sep, rest = origin.partition(",")
    category, value = (head.strip(), rest.strip()) if sep else ("", origin.strip())
    if not sep and value in ORIGIN_CATEGORIES:
        category, value = value, ""
    if category and category not in ORIGIN_CATEGORIES:
        return (
            f"Origin: {category!r} is not a DEP-3 category "
            f"({', '.join(ORIGIN_CATEGORIES)})"
        )
    if category in UPSTREAM_ORIGINS and not _URL_RE.match(value):
        return (
            f"Origin: an {category} origin carries the URL of the upstream change "
            f"('{category}, https://...'), got {origin!r}"
        )
    if not category and not _URL_RE.match(value):
        return (
            f"Origin: {origin!r} is neither a URL nor '<category>, <URL or commit>' "
            f"({', '.join(ORIGIN_CATEGORIES)})"
        )
    return None


def header_problems(text: str, name: str) -> tuple[PatchHeader | None, list[str]]:
    """The parsed header, or None, and every problem it has (one line each)."""
    fields, problems = _read_fields(text, name)
    for f in REQUIRED_FIELDS:
        if f not in fields:
            problems.append(f"{name}: header lacks {f}")
    problems.extend(
        f"{name}: {f} is empty (DEP-3 leaves an optional field out instead)"
        for f, value in fields.items()
        if not value and f in (*REQUIRED_FIELDS, *OPTIONAL_FIELDS)
    )
    given = [f for f in DESCRIPTION_FIELDS if f in fields]
    if not given:
        problems.append(f"{name}: header lacks Description (or Subject)")
    elif len(given) > 1:
        problems.append(
            f"{name}: Description and Subject: DEP-3 takes one of them, not both"
        )
    description = fields.get("Description", [])
    if description and len(description) < 2:
        problems.append(
            f"{name}: Description holds only its first line (the PR title); "
            "its continuation lines are the long description"
        )
    author = " ".join(fields.get("Author", []))
    if author.partition("<")[0].strip() == PROJECT_NAME and not _IDENTITY_RE.match(
        author
    ):
        problems.append(
            f"{name}: Author: {PROJECT_NAME} without an address; write "
            f"'{PROJECT_NAME} <email>' as patches/{AUTHORS_FILE} says"
        )

    def joined(field: str) -> str:
        return " ".join(fields.get(field, []))

    def words(field: str) -> list[str]:
        return [w for v in fields.get(field, []) for w in v.split()]

    forwarded = joined("Forwarded")
    if (
        forwarded
        and forwarded not in ("no", "not-needed")
        and not _URL_RE.match(forwarded)
    ):
        problems.append(
            f"{name}: Forwarded: {forwarded!r} is not a DEP-3 value (no, "
            "not-needed, or the URL the change was sent to)"
        )
    if joined("Origin") and (problem := _origin_problem(joined("Origin"))):
        problems.append(f"{name}: {problem}")
    last_update = joined("Last-Update")
    if last_update and not _DATE_RE.match(last_update):
        problems.append(f"{name}: Last-Update: {last_update!r} is not YYYY-MM-DD")
    problems.extend(
        f"{name}: Builds-On: {url!r} is not a URL"
        for url in words("Builds-On")
        if not _URL_RE.match(url)
    )
    tests, guards = words("Tests"), words("Guards")
    problems.extend(
        f"{name}: {test_id} is both in Tests and in Guards"
        for test_id in dict.fromkeys(tests)
        if test_id in guards
    )
    if problems:
        return None, problems
    summary = fields.get("Description") or fields["Subject"]
    header = PatchHeader(
        subject=summary[0],
        description="\n".join(summary[1:]),
        origin=joined("Origin"),
        author=joined("Author"),
        forwarded=forwarded,
        applied_upstream=joined("Applied-Upstream"),
        remove_when=joined("Remove-When"),
        tests=tests,
        last_update=last_update,
        guards=guards,
        builds_on=words("Builds-On"),
        reviewed_by=joined("Reviewed-by"),
        bug=joined("Bug"),
    )
    return header, []


def parse_header(text: str, name: str) -> PatchHeader:
    header, problems = header_problems(text, name)
    if header is None:
        raise SeriesError(problems[0])
    return header


def set_header_field(head: str, field: str, value: str) -> str:
    """``head`` (a DEP-3 header) with ``field``'s value (and its
    continuation lines) replaced by ``value``, every other byte kept; a
    ``SeriesError`` when the header has no such field."""
    lines = head.splitlines(keepends=True)
    for i, line in enumerate(lines):
        key, sep, _ = line.partition(":")
        if not sep or line[:1] in " \t" or key.strip().lower() != field.lower():
            continue
        end = i + 1
        while end < len(lines) and lines[end][:1] in (" ", "\t"):
            end += 1
        new = f"{key}: {value}".rstrip() + "\n"
        return "".join(lines[:i] + [new] + lines[end:])
    raise SeriesError(f"the header has no {field} field")


def put_header_field(
    head: str, field: str, value: str, after: str = "Forwarded"
) -> str:
    """``head`` with ``field`` set to ``value``: replaced where the header has
    it, else added after the ``after`` field (its continuation lines
    included), else at the end. An optional field such as Applied-Upstream is
    left out of a header until it has a value (DEP-3)."""
    try:
        return set_header_field(head, field, value)
    except SeriesError:
        pass
    lines = head.splitlines(keepends=True)
    at = len(lines)
    for i, line in enumerate(lines):
        key, sep, _ = line.partition(":")
        if sep and line[:1] not in " \t" and key.strip().lower() == after.lower():
            at = i + 1
            while at < len(lines) and lines[at][:1] in (" ", "\t"):
                at += 1
    return "".join(lines[:at] + [f"{field}: {value}\n"] + lines[at:])


@dataclass(frozen=True)
class DroppedPatch:
    """A patch upstream vLLM has: its header, kept when it left the series."""

    name: str  # the record's file name, ``<slug>.dep3``
    header: PatchHeader


def dropped_record(head: str, version: str) -> str:
    """The record of a dropped patch: its header, ``Applied-Upstream:
    <version>``."""
    return put_header_field(head, "Applied-Upstream", version)


def dropped_problems(patch_dir: Path) -> tuple[list[DroppedPatch], list[str]]:
    """Every record in ``patch_dir/dropped`` and what is wrong with them (a
    header that does not parse, an empty ``Applied-Upstream``)."""
    records: list[DroppedPatch] = []
    problems: list[str] = []
    folder = patch_dir / DROPPED_DIR
    if not folder.is_dir():
        return records, problems
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        rel = f"{DROPPED_DIR}/{path.name}"
        if path.suffix != DROPPED_SUFFIX or not path.is_file():
            problems.append(f"{rel}: not a {DROPPED_SUFFIX} record of a dropped patch")
            continue
        try:
            text = _read_text(path, rel)
        except SeriesError as e:
            problems.append(str(e))
            continue
        header, issues = header_problems(text, rel)
        problems.extend(issues)
        if header is None:
            continue
        if not header.applied_upstream:
            problems.append(
                f"{rel}: Applied-Upstream is empty (a dropped patch names the "
                "vLLM release that has it)"
            )
        records.append(DroppedPatch(path.name, header))
    return records, problems


def load_patch(path: Path, index: int) -> SeriesPatch:
    text = _read_text(path, path.name)
    head, body = split_header(text, path.name)
    header = parse_header(head, path.name)
    try:
        files = tuple(parse_patch(body))
    except DiffError as e:
        raise SeriesError(f"{path.name}: not a unified diff: {e}") from None
    return SeriesPatch(index, path.name, path, text, header, files)


def entry_problems(names: list[str]) -> list[str]:
    """What is wrong with the entries of the series file."""
    problems: list[str] = []
    seen: set[str] = set()
    for name in names:
        if name in seen:
            problems.append(f"series lists {name} more than once")
        seen.add(name)
        if "/" in name or name.startswith(".") or not name.endswith(".patch"):
            problems.append(f"series entry {name!r} must be a .patch file in patches/")
    return problems


def load_series(root: Path) -> Series:
    """Load and parse every patch listed in ``root/patches/series``; an entry
    listed twice or naming anything but a patch file there is an error."""
    patch_dir = root / PATCH_DIR
    names = read_series_file(patch_dir)
    return load_listed(root, patch_dir, names, entry_problems(names), "series")


def load_listed(
    root: Path, directory: Path, names: list[str], bad: list[str], what: str
) -> Series:
    """The patches ``names`` in ``directory``, in order; the first of ``bad``
    (problems of the entries) or a listed file that is missing is an error."""
    if bad:
        raise SeriesError(bad[0])
    patches = []
    for i, name in enumerate(names, 1):
        path = directory / name
        if not path.is_file():
            raise SeriesError(f"{what} lists {name}, but {path} does not exist")
        patches.append(load_patch(path, i))
    return Series(root, tuple(patches))


def check_series(
    root: Path, pin: Pin, *, tests: bool = True, allow_empty: bool = False
) -> list[str]:
    """Every problem of the series, one line each (empty: the series is sound).
    ``tests=False`` leaves out whether the test files the headers name exist
    (an install of the overlay carries no tests; `apply` checks the rest). A
    series listing no patch is a problem unless ``allow_empty``."""
    patch_dir = root / PATCH_DIR
    try:
        names = read_series_file(patch_dir)
    except SeriesError as e:
        return [str(e)]
    problems = entry_problems(names)
    if not names and not allow_empty:
        problems.append(
            f"{patch_dir / SERIES_FILE} lists no patch (applying it is the pinned "
            "base; `series check --allow-empty` accepts that)"
        )
    seen = set(names)
    on_disk = {p.name for p in patch_dir.glob("*.patch")}
    for name in sorted(on_disk - seen):
        problems.append(f"{name} is in patches/ but not listed in the series")
    loaded: list[SeriesPatch] = []
    for i, name in enumerate(dict.fromkeys(names), 1):
        path = patch_dir / name
        if not path.is_file():
            problems.append(f"series lists {name}, but {path} does not exist")
            continue
        try:
            text = _read_text(path, name)
            head, body = split_header(text, name)
        except SeriesError as e:
            problems.append(str(e))
            continue
        header, header_issues = header_problems(head, name)
        problems.extend(header_issues)
        try:
            files = tuple(parse_patch(body))
        except DiffError as e:
            problems.append(f"{name}: not a unified diff: {e}")
            continue
        for fp in files:
            if fp.path not in pin.files:
                problems.append(f"{name}: touches {fp.path}, which is not pinned")
        if header is not None:
            loaded.append(SeriesPatch(i, name, path, text, header, files))
    dropped, dropped_issues = dropped_problems(patch_dir)
    problems += dropped_issues
    problems += _author_problems(patch_dir, loaded)
    return problems + _series_problems(root, loaded, tests, dropped)


def project_identity(patch_dir: Path) -> tuple[str | None, list[str]]:
    """The address line of patches/AUTHORS (``Name <email>``), None when the
    file is missing, and what is wrong with it."""
    path = patch_dir / AUTHORS_FILE
    if not path.is_file():
        return None, []
    rel = f"{AUTHORS_FILE}"
    try:
        text = _read_text(path, rel)
    except SeriesError as e:
        return None, [str(e)]
    entries = [ln.strip() for ln in text.splitlines() if ln.strip() and ln[:1] != "#"]
    if len(entries) != 1 or not _IDENTITY_RE.match(entries[0]):
        return None, [
            f"{rel}: holds {len(entries)} address line(s); it needs one, "
            f"'{PROJECT_NAME} <email>'"
        ]
    return entries[0], []


def _author_problems(patch_dir: Path, patches: list[SeriesPatch]) -> list[str]:
    """This project's patches carry the address patches/AUTHORS gives."""
    ours = [
        p for p in patches if p.header.author.partition("<")[0].strip() == PROJECT_NAME
    ]
    identity, problems = project_identity(patch_dir)
    if not ours or problems:
        return problems
    if identity is None:
        return [
            f"patches/{AUTHORS_FILE} is missing: {ours[0].name} is this "
            f"project's ({PROJECT_NAME}), whose address it holds"
        ]
    return [
        f"{p.name}: Author: {p.header.author!r} is not patches/{AUTHORS_FILE}'s "
        f"{identity!r}"
        for p in ours
        if p.header.author != identity
    ]


def _series_problems(
    root: Path,
    patches: list[SeriesPatch],
    tests: bool,
    dropped: list[DroppedPatch] = [],  # noqa: B006 (never mutated)
) -> list[str]:
    """What a patch's header says about the rest of the series and (unless
    ``tests`` is false) the test files it names. A patch may build on a
    dropped one (upstream has it)."""
    problems: list[str] = []
    named_by: dict[str, str] = {}
    upstream_urls = {
        u for d in dropped for u in (d.header.upstream_url, d.header.origin_url) if u
    }
    for patch in patches:
        h, name = patch.header, patch.name
        if not h.tests:
            problems.append(f"{name}: Tests names no test")
        for field, ids in (("Tests", h.tests), ("Guards", h.guards)):
            for test_id in ids if tests else ():
                test_file = test_id.split("::", 1)[0]
                if not (root / test_file).is_file():
                    problems.append(
                        f"{name}: {field} names {test_id}, but {test_file} is missing"
                    )
        for test_id in h.tests:
            if test_id in named_by:
                problems.append(
                    f"{name}: Tests names {test_id}, which {named_by[test_id]} "
                    "already names (a test proves one patch)"
                )
            named_by.setdefault(test_id, name)
        for url in h.builds_on:
            if url not in upstream_urls:
                problems.append(
                    f"{name}: Builds-On {url} is not the upstream URL of an "
                    "earlier patch in the series or of a dropped one"
                )
        upstream_urls |= {u for u in (h.upstream_url, h.origin_url) if u}
    return problems
