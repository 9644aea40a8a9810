"""Whether the new base already holds a hunk's change, and the evidence.

A hunk is looked for where it would sit in the new base: the lines it covers
in the text it was made for (the old base with the patches below it) are
mapped onto the new base through a line diff of the two, and widened by
``SLACK`` lines either side (the *region*).

Only lines that say something count as evidence:

- a line the hunk adds is evidence when it is not trivial (blank, only
  punctuation such as ``)`` or ``],``, or a lone keyword such as ``else:``)
  and does not occur anywhere in the text the hunk was made for: finding a
  line that already existed proves nothing;
- a line the hunk removes is evidence when it is not trivial and the hunk
  does not add it back (a moved line is neither added nor removed).

A hunk has *landed* when it has evidence and either its whole post-image
(context and added lines, verbatim) is in the region, or every evidence line
it adds is in the region in the same order, none of the evidence lines it
removes is left there, and every other non-trivial line it adds is there too.
A hunk without evidence (whitespace, punctuation, lines that existed
already) never counts as landed by itself; ``classify`` lets it follow the
rest of its patch when its post-image is verbatim in place.

A hunk that has not landed is *changed upstream in another form* when
upstream rewrote the very lines it changes (every evidence line it removes
is gone from the region) and something of ours is there: some of its
evidence lines in the region, or some of the *new names* it adds anywhere in
the new base. A new name is an identifier (``snake_case`` with an
underscore, or ``CamelCase`` with an inner capital, at least ``MIN_NAME``
characters) in the code of a line it adds (before any ``#``) that stands
nowhere in the text the hunk was made for. ``anotherform`` weighs these.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_overlay.series.diff import FilePatch, Hunk

# How far (in lines) either side of its mapped position a hunk's lines are
# looked for.
SLACK = 10
# The shortest identifier that counts as a new name (shorter ones, such as
# ``i_j``, are too common to show anything).
MIN_NAME = 4
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Lines that carry no evidence although they hold a word.
_TRIVIAL = frozenset(
    {
        "else:",
        "try:",
        "finally:",
        "pass",
        "return",
        "return None",
        "continue",
        "break",
        "raise",
        "None",
        "True",
        "False",
        "None,",
        "True,",
        "False,",
    }
)


def is_trivial(line: str) -> bool:
    """Blank, only punctuation, or a lone keyword: no evidence either way."""
    s = line.strip()
    return not any(c.isalnum() for c in s) or s in _TRIVIAL


def _key(line: str) -> str:
    return line.rstrip()


def _looks_like_name(word: str) -> bool:
    """``snake_case`` or ``CamelCase``: a name someone chose, not a word of
    prose (a comment or docstring word such as ``Sliding`` is not one)."""
    inner_capital = any(c.isupper() for c in word[1:]) and any(
        c.islower() for c in word
    )
    return len(word) >= MIN_NAME and ("_" in word.strip("_") or inner_capital)


def names_in(lines: Sequence[str]) -> list[str]:
    """The names in the code of ``lines`` (before any ``#``), in order, once."""
    seen: dict[str, None] = {}
    for line in lines:
        code = line.split("#", 1)[0]
        for word in _NAME_RE.findall(code):
            if _looks_like_name(word):
                seen.setdefault(word, None)
    return list(seen)


@dataclass
class HunkCheck:
    """What the new base holds of one hunk (line numbers are 1-based lines
    of the new base)."""

    index: int  # 0-based, in the patch's order for its file
    hunk: Hunk
    region: tuple[int, int]  # first and last line looked at
    added: list[str] = field(default_factory=list)  # evidence lines it adds
    found: list[tuple[int, str]] = field(default_factory=list)  # ... in order
    removed: list[str] = field(default_factory=list)  # evidence lines it removes
    still: list[tuple[int, str]] = field(default_factory=list)  # ... left there
    others_missing: list[str] = field(default_factory=list)  # other added lines
    post_at: int | None = None  # where its post-image is, verbatim
    names: list[str] = field(default_factory=list)  # new names it adds
    names_found: list[str] = field(default_factory=list)  # ... in the new base

    @property
    def has_evidence(self) -> bool:
        return bool(self.added or self.removed)

    @property
    def exact(self) -> bool:
        return self.has_evidence and self.post_at is not None

    @property
    def near(self) -> bool:
        return (
            bool(self.added)
            and len(self.found) == len(self.added)
            and not self.still
            and not self.others_missing
        )

    @property
    def landed(self) -> bool:
        """Landed on its own evidence."""
        return self.exact or self.near

    @property
    def changed_upstream(self) -> bool:
        """Not landed, but every evidence line it removes is gone: upstream
        changed the very lines this hunk changes."""
        return not self.landed and bool(self.removed) and not self.still

    @property
    def in_another_form(self) -> bool:
        """Changed upstream, and something of ours is there: some of its
        evidence lines in the region or some of its new names in the file."""
        return self.changed_upstream and bool(self.found or self.names_found)

    def evidence(self) -> list[str]:
        """The new base's lines that show the hunk landed, ``LINE: text``."""
        if self.post_at is not None:
            lines = self.hunk.new_lines()
            return [
                f"{self.post_at + k}: {_key(text).strip()}"
                for k, (tag, text) in enumerate(
                    (t, x) for t, x in self.hunk.lines if t != "-"
                )
                if tag == "+"
            ] or [f"{self.post_at}-{self.post_at + len(lines) - 1}: (post-image)"]
        return [f"{n}: {text.strip()}" for n, text in self.found]

    def landed_summary(self, trivial_follows: bool = False) -> str:
        """One line: why the hunk counts as landed."""
        if self.post_at is not None:
            end = self.post_at + len(self.hunk.new_lines()) - 1
            how = f"its post-image is at lines {self.post_at}-{end}"
            if trivial_follows:
                return how + " (no evidence of its own: it follows its patch)"
            return how
        where = ", ".join(str(n) for n, _ in self.found)
        gone = f"; the {len(self.removed)} it removes are gone" if self.removed else ""
        return (
            f"its {len(self.added)} new line(s) are at lines {where}{gone} "
            "(context differs)"
        )

    def problem(self) -> str:
        """Why a hunk that does not apply has not landed either."""
        parts = ["context not found"]
        if not self.has_evidence:
            parts.append("it adds or removes no line that is evidence")
        elif self.changed_upstream:
            parts.append(
                f"changed upstream: the {len(self.removed)} line(s) it removes are gone"
            )
        elif self.still:
            parts.append(
                f"{len(self.still)} of the {len(self.removed)} line(s) it removes "
                "are still there"
            )
        if self.added:
            found, added = len(self.found), len(self.added)
            parts.append(f"{found} of its {added} new line(s) there")
        if self.names_found:
            parts.append(f"its new name(s) there: {', '.join(self.names_found)}")
        return "; ".join(parts)


def _map_region(
    opcodes: Sequence[tuple[str, int, int, int, int]], a0: int, a1: int
) -> tuple[int, int]:
    """The new lines [b0, b1) that old lines [a0, a1) became; for an empty
    range (a hunk that only inserts), where its insertion point went."""
    b0: int | None = None
    b1: int | None = None
    for tag, i1, i2, j1, j2 in opcodes:
        if tag == "equal":
            lo, hi = max(a0, i1), min(a1, i2)
            if a0 == a1 and i1 <= a0 <= i2:
                lo = hi = a0
            elif lo >= hi:
                continue
            start, end = j1 + lo - i1, j1 + hi - i1
        elif (i1 < a1 and i2 > a0) or (i1 == i2 and a0 <= i1 <= a1):
            start, end = j1, j2
        else:
            continue
        b0 = start if b0 is None else min(b0, start)
        b1 = end if b1 is None else max(b1, end)
    # The opcodes cover every old line and both ends: something maps.
    assert b0 is not None and b1 is not None
    return b0, b1


def _in_order(
    wanted: Sequence[str], lines: Sequence[str], first: int
) -> list[tuple[int, str]]:
    """Greedy: each wanted line at the first place after the last one found
    (a line that is not there is skipped)."""
    found: list[tuple[int, str]] = []
    at = 0
    for want in wanted:
        try:
            k = lines.index(want, at)
        except ValueError:
            continue
        found.append((first + k + 1, want))
        at = k + 1
    return found


def _find_block(block: Sequence[str], lines: Sequence[str]) -> int | None:
    n = len(block)
    for k in range(len(lines) - n + 1):
        if list(lines[k : k + n]) == list(block):
            return k
    return None


def check_hunks(old_pre: str, new_pre: str, fp: FilePatch) -> list[HunkCheck]:
    """Each hunk of ``fp`` (made for ``old_pre``, which it applies to
    exactly) looked for in ``new_pre``."""
    old = [_key(x) for x in old_pre.splitlines()]
    new = [_key(x) for x in new_pre.splitlines()]
    old_set = set(old)
    # Any occurrence (code, comment, string) makes a word not new / there.
    old_names = set(_NAME_RE.findall(old_pre))
    new_names = set(_NAME_RE.findall(new_pre))
    opcodes = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
    checks = []
    for index, hunk in enumerate(fp.hunks):
        a0 = hunk.old_start - 1 if hunk.old_len else hunk.old_start
        a1 = a0 + hunk.old_len
        b0, b1 = _map_region(opcodes, a0, a1)
        lo, hi = max(0, b0 - SLACK), min(len(new), b1 + SLACK)
        window = new[lo:hi]
        old_window = old[max(0, a0 - SLACK) : a1 + SLACK]
        plus = [_key(t) for tag, t in hunk.lines if tag == "+"]
        minus = [_key(t) for tag, t in hunk.lines if tag == "-"]
        added = [x for x in plus if not is_trivial(x) and x not in old_set]
        others = [x for x in plus if not is_trivial(x) and x in old_set]
        removed = [x for x in minus if not is_trivial(x) and x not in plus]
        check = HunkCheck(index, hunk, (lo + 1, hi), added=added, removed=removed)
        check.found = _in_order(added, window, lo)
        check.names = [x for x in names_in(plus) if x not in old_names]
        check.names_found = [x for x in check.names if x in new_names]
        check.others_missing = [x for x in others if x not in window]
        left = Counter(window)
        before = Counter(old_window)
        for line, count in Counter(removed).items():
            if left[line] > before[line] - count:
                k = window.index(line)
                check.still.append((lo + k + 1, line))
        post = [_key(t) for t in hunk.new_lines()]
        if post:
            at = _find_block(post, window)
            check.post_at = None if at is None else lo + at + 1
        checks.append(check)
    return checks
