"""Unified diffs: parse git-style patches and apply them exactly.

No fuzz, ever: every context and removed line of a hunk must match the target
byte for byte. By default a hunk must also sit at the line its header names
(``offset=False``); the rebase workflow asks for ``offset=True`` to learn
whether a hunk still applies somewhere else, and reports the offsets.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")
_NO_NEWLINE = "\\ No newline at end of file"


class DiffError(Exception):
    """A patch text is not a well-formed unified diff."""


class HunkError(Exception):
    """A hunk does not apply exactly."""

    def __init__(self, path: str, hunk_index: int, hunk: Hunk, reason: str):
        self.path = path
        self.hunk_index = hunk_index
        self.hunk = hunk
        self.reason = reason
        super().__init__(
            f"{path}: hunk #{hunk_index + 1} ({hunk.header}) does not apply: {reason}"
        )


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    section: str
    # (tag, text) with tag in " ", "-", "+"; text keeps its line ending.
    lines: tuple[tuple[str, str], ...]

    @property
    def header(self) -> str:
        old, new = (
            f"{self.old_start},{self.old_len}",
            f"{self.new_start},{self.new_len}",
        )
        return f"@@ -{old} +{new} @@"

    def old_lines(self) -> list[str]:
        return [text for tag, text in self.lines if tag != "+"]

    def new_lines(self) -> list[str]:
        return [text for tag, text in self.lines if tag != "-"]

    def reversed(self) -> Hunk:
        swap = {" ": " ", "-": "+", "+": "-"}
        return Hunk(
            old_start=self.new_start,
            old_len=self.new_len,
            new_start=self.old_start,
            new_len=self.old_len,
            section=self.section,
            lines=tuple((swap[tag], text) for tag, text in self.lines),
        )


@dataclass(frozen=True)
class FilePatch:
    old_path: str
    new_path: str
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        return self.new_path

    def reversed(self) -> FilePatch:
        return FilePatch(
            old_path=self.new_path,
            new_path=self.old_path,
            hunks=tuple(h.reversed() for h in self.hunks),
        )


@dataclass(frozen=True)
class AppliedHunk:
    index: int
    offset: int


@dataclass
class ApplyResult:
    text: str
    hunks: list[AppliedHunk] = field(default_factory=list)

    @property
    def max_offset(self) -> int:
        return max((abs(h.offset) for h in self.hunks), default=0)


def _strip_prefix(path: str) -> str:
    path = path.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return path
    if path.startswith(("a/", "b/")):
        return path[2:]
    return path


# Lines of a git diff that change something other than text lines: modes,
# renames and copies, binary contents. A patch holding one is refused (its
# change would otherwise be skipped without a word).
_NOT_TEXT = (
    ("old mode ", "a mode change"),
    ("new mode ", "a mode change"),
    ("new file mode ", "a new file"),
    ("deleted file mode ", "a deleted file"),
    ("rename from ", "a rename"),
    ("rename to ", "a rename"),
    ("copy from ", "a copy"),
    ("copy to ", "a copy"),
    ("similarity index ", "a rename or copy"),
    ("dissimilarity index ", "a rewrite"),
    ("GIT binary patch", "a binary patch"),
    ("Binary files ", "a binary file"),
)


def _not_text(line: str) -> str | None:
    for prefix, what in _NOT_TEXT:
        if line.startswith(prefix):
            return what
    return None


def parse_patch(text: str) -> list[FilePatch]:
    """Parse the unified diff part of ``text`` (anything before the first
    ``diff --git`` / ``---`` file header is ignored). Anything but text
    hunks (a binary, mode, rename or copy section) is a ``DiffError``."""
    lines = text.splitlines(keepends=True)
    files: list[FilePatch] = []
    i = 0
    n = len(lines)
    in_git = False  # inside a `diff --git` section, before its hunks
    while i < n:
        line = lines[i]
        if line.startswith("diff --git "):
            if in_git:
                raise DiffError(
                    f"line {i + 1}: the `diff --git` section before this line has "
                    "no text hunks (a binary, mode or rename change?)"
                )
            in_git = True
        elif in_git and (what := _not_text(line)) is not None:
            raise DiffError(
                f"line {i + 1}: {what} ({line.rstrip()!r}); only text hunks can "
                "be applied"
            )
        is_header = line.startswith("--- ") and i + 1 < n
        if not (is_header and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        in_git = False
        old_path = _strip_prefix(line[4:].rstrip("\r\n"))
        new_path = _strip_prefix(lines[i + 1][4:].rstrip("\r\n"))
        if old_path == "/dev/null" or new_path == "/dev/null":
            raise DiffError(
                f"line {i + 1}: creating or deleting files is not supported "
                f"({old_path} -> {new_path})"
            )
        if old_path != new_path:
            raise DiffError(
                f"line {i + 1}: {old_path} -> {new_path} renames a file; only "
                "text hunks can be applied"
            )
        i += 2
        hunks: list[Hunk] = []
        while i < n and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i)
            hunks.append(hunk)
        if not hunks:
            raise DiffError(f"{new_path}: file header without hunks")
        files.append(FilePatch(old_path, new_path, tuple(hunks)))
    if in_git:
        raise DiffError("the last `diff --git` section has no text hunks")
    if not files:
        raise DiffError("no file diffs found")
    seen: set[str] = set()
    for fp in files:
        if fp.path in seen:
            raise DiffError(f"{fp.path}: appears twice in one patch")
        seen.add(fp.path)
    return files


def _parse_hunk(lines: Sequence[str], i: int) -> tuple[Hunk, int]:
    m = _HUNK_RE.match(lines[i].rstrip("\r\n"))
    if not m:
        raise DiffError(f"line {i + 1}: malformed hunk header {lines[i]!r}")
    old_start, new_start = int(m.group(1)), int(m.group(3))
    old_len = int(m.group(2)) if m.group(2) is not None else 1
    new_len = int(m.group(4)) if m.group(4) is not None else 1
    body: list[tuple[str, str]] = []
    seen_old = seen_new = 0
    i += 1
    while seen_old < old_len or seen_new < new_len:
        if i >= len(lines):
            raise DiffError(f"hunk at -{old_start}: truncated")
        line = lines[i]
        tag = line[:1]
        if line.rstrip("\r\n") == _NO_NEWLINE:
            # The line before has no final newline (one side ends there).
            if body:
                prev_tag, prev_text = body[-1]
                body[-1] = (prev_tag, prev_text.rstrip("\n"))
            i += 1
            continue
        if tag not in (" ", "-", "+"):
            if line in ("\n", "\r\n"):
                # Some editors strip the space of empty context lines.
                tag, line = " ", " " + line
            else:
                raise DiffError(f"line {i + 1}: unexpected line in hunk: {line!r}")
        body.append((tag, line[1:]))
        if tag != "+":
            seen_old += 1
        if tag != "-":
            seen_new += 1
        i += 1
    if seen_old != old_len or seen_new != new_len:
        raise DiffError(f"hunk at -{old_start}: line counts do not match its header")
    # "\ No newline at end of file" after the last line of a side.
    while i < len(lines) and lines[i].rstrip("\r\n") == _NO_NEWLINE:
        prev_tag, prev_text = body[-1]
        body[-1] = (prev_tag, prev_text.rstrip("\n"))
        i += 1
    section = m.group(5).strip()
    return Hunk(old_start, old_len, new_start, new_len, section, tuple(body)), i


def _matches_at(source: Sequence[str], start: int, expected: Sequence[str]) -> bool:
    if start < 0 or start + len(expected) > len(source):
        return False
    return all(source[start + k] == expected[k] for k in range(len(expected)))


def apply_file_patch(
    text: str, patch: FilePatch, *, offset: bool = False
) -> ApplyResult:
    """Apply ``patch`` to ``text`` exactly; raise ``HunkError`` otherwise.

    With ``offset=False`` every hunk must match at the line its header names.
    With ``offset=True`` a hunk may match elsewhere (nearest position first),
    after the previous hunk, still with every line identical.
    """
    source = text.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0
    applied: list[AppliedHunk] = []
    for index, hunk in enumerate(patch.hunks):
        old = hunk.old_lines()
        # A zero-length old side names the line *after which* to insert.
        expected = hunk.old_start - 1 if hunk.old_len else hunk.old_start
        if _matches_at(source, expected, old) and expected >= cursor:
            at = expected
        elif offset:
            found_at = _search(source, old, expected, cursor)
            if found_at is None:
                raise HunkError(patch.path, index, hunk, "context not found")
            at = found_at
        else:
            found = _search(source, old, expected, cursor)
            reason = (
                f"context matches only at line {found + 1} (offset "
                f"{found - expected:+d}); offsets are not accepted"
                if found is not None
                else "context differs from the target"
            )
            raise HunkError(patch.path, index, hunk, reason)
        out.extend(source[cursor:at])
        out.extend(hunk.new_lines())
        cursor = at + len(old)
        applied.append(AppliedHunk(index=index, offset=at - expected))
    out.extend(source[cursor:])
    return ApplyResult(text="".join(out), hunks=applied)


def _search(
    source: Sequence[str], old: Sequence[str], expected: int, lower: int
) -> int | None:
    limit = len(source) - len(old)
    for distance in range(0, max(limit, 0) + len(source) + 1):
        for at in (expected - distance, expected + distance):
            if lower <= at <= limit and _matches_at(source, at, old):
                return at
        if expected - distance < lower and expected + distance > limit:
            return None
    return None


def touched_paths(patches: Iterable[FilePatch]) -> list[str]:
    return sorted({p.path for p in patches})


def git_blob_sha1(data: bytes) -> str:
    """The object id git gives ``data`` as a blob (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def unified_diff(path: str, old: str, new: str, *, context: int = 3) -> str:
    """A git-style diff (``diff --git``, ``a/``/``b/`` paths) from ``old`` to
    ``new``; empty when they are equal. Exact: ``parse_patch`` of the result
    applied to ``old`` gives ``new``, final newlines included."""
    if old == new:
        return ""
    body = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=f"a/{path}",
        tofile=f"b/{path}",
        n=context,
    )
    out = [f"diff --git a/{path} b/{path}\n"]
    for line in body:
        out.append(line)
        if not line.endswith("\n"):
            out.append(f"\n{_NO_NEWLINE}\n")
    return "".join(out)


def shift_hunk_headers(text: str, shifts: Mapping[str, Sequence[int]]) -> str:
    """``text`` (a diff, anything around it kept byte for byte) with the hunk
    headers of file ``path`` moved by ``shifts[path][k]`` lines, hunk ``k``.

    Only the ``@@ -a,b +c,d @@`` numbers change; a file not in ``shifts``
    keeps its headers. Hunk bodies are untouched, so the result applies
    exactly wherever the original applied at those offsets."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    current: list[int] | None = None
    k = 0
    for i, line in enumerate(lines):
        if line.startswith("+++ ") and i > 0 and lines[i - 1].startswith("--- "):
            path = _strip_prefix(line[4:].rstrip("\r\n"))
            current = list(shifts[path]) if path in shifts else None
            k = 0
        elif current is not None and line.startswith("@@"):
            m = _HUNK_RE.match(line.rstrip("\r\n"))
            if m is None:
                raise DiffError(f"malformed hunk header {line!r}")
            if k >= len(current):
                raise DiffError(f"more hunks than shifts ({len(current)})")
            delta = current[k]
            k += 1
            old_start = int(m.group(1)) + delta
            new_start = int(m.group(3)) + delta
            old_len = "" if m.group(2) is None else f",{m.group(2)}"
            new_len = "" if m.group(4) is None else f",{m.group(4)}"
            ending = line[len(line.rstrip("\r\n")) :]
            line = (
                f"@@ -{old_start}{old_len} +{new_start}{new_len} @@{m.group(5)}"
                + ending
            )
        out.append(line)
    return "".join(out)


def format_hunk(hunk: Hunk) -> str:
    """The text of ``hunk``: its ``@@`` line (with its section) and its lines,
    a line without a final newline marked as git marks it."""
    head = f"{hunk.header} {hunk.section}" if hunk.section else hunk.header
    out = [head + "\n"]
    for tag, text in hunk.lines:
        out.append(tag + text)
        if not text.endswith("\n"):
            out.append(f"\n{_NO_NEWLINE}\n")
    return "".join(out)


def place_hunks(hunks: Sequence[Hunk], offsets: Sequence[int]) -> tuple[Hunk, ...]:
    """``hunks`` (in order, not overlapping) with their headers recomputed
    for a target where hunk ``k`` sits ``offsets[k]`` lines from where its
    header says: the old start moves by the offset, the new start follows
    from the hunks before it. A subset of a patch's hunks, placed with the
    offsets at which it applies, is a patch of its own."""
    if len(hunks) != len(offsets):
        raise ValueError(f"{len(hunks)} hunks, {len(offsets)} offsets")
    out = []
    delta = 0
    for hunk, offset in zip(hunks, offsets, strict=True):
        old_start = hunk.old_start + offset
        at = old_start - 1 if hunk.old_len else old_start
        new_start = at + delta + (1 if hunk.new_len else 0)
        delta += hunk.new_len - hunk.old_len
        out.append(
            Hunk(
                old_start,
                hunk.old_len,
                new_start,
                hunk.new_len,
                hunk.section,
                hunk.lines,
            )
        )
    return tuple(out)


def format_file_patch(fp: FilePatch, index_line: str = "") -> str:
    """A git-style section for ``fp``: ``diff --git``, ``index_line`` when
    given (``index a..b 100644``), the file header and every hunk as it is."""
    head = f"diff --git a/{fp.old_path} b/{fp.new_path}\n"
    if index_line:
        head += index_line.rstrip("\n") + "\n"
    head += f"--- a/{fp.old_path}\n+++ b/{fp.new_path}\n"
    return head + "".join(format_hunk(h) for h in fp.hunks)
