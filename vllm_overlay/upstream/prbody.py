"""The upstream pull-request body (Markdown) and commit message of a patch.

Built only from the patch header, the diff, the ported test file and results
of real runs handed in by the caller (the unit-base rows of the tests the
patch names, on the stack below it and with it; the ruff run; the
ported-test run). The description is read as: its first line
is the purpose; the paragraph starting with "Root cause" (else the first
paragraph after the summary) is the root cause; every other paragraph
describes the changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vllm_overlay.gate.reports import RevertRedReport, RevertRedRow, StackRow
from vllm_overlay.series.patch_series import PatchHeader
from vllm_overlay.text import count, verb

GITHUB_BODY_LIMIT = 65536
_LIST_ITEM = re.compile(r"^(?:[-*+]|\d+[.)])\s")
_ROOT_CAUSE = re.compile(r"^root cause\s*[:\-—]?\s*", re.I)
_URL = re.compile(r"https?://\S+")


class BodyError(ValueError):
    """The header does not hold what a PR body needs."""


@dataclass(frozen=True)
class Sections:
    purpose: str
    root_cause: list[str]
    changes: list[str]


def split_description(header: PatchHeader) -> Sections:
    lines = header.description.split("\n")
    rest = "\n".join(lines[1:]).strip("\n")
    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", rest) if p.strip()]
    if not paragraphs:
        raise BodyError(
            "the Description holds only its summary line; the PR body needs the "
            "root cause and the changes (continuation lines of Description)"
        )
    root = [p for p in paragraphs if _ROOT_CAUSE.match(p)]
    if root:
        root_cause = [_capitalize(_ROOT_CAUSE.sub("", p, count=1)) for p in root]
        changes = [p for p in paragraphs if p not in root]
    else:
        root_cause, changes = paragraphs[:1], paragraphs[1:]
    return Sections(_capitalize(lines[0].strip()), root_cause, changes)


_CHANGES_LABEL = re.compile(r"^(?:what changes|changes?)\s*:\s*", re.I)
_OTHER_LABEL = re.compile(r"^([A-Z][\w-]*(?: [\w-]+){0,3}(?: \([^)\n]*\))?):\s")


def label_changes(paragraph: str) -> str:
    """ "What changes:" / "Changes:" dropped (the section says it); another
    short leading label ("Contract change:") set in bold."""
    stripped = _CHANGES_LABEL.sub("", paragraph, count=1)
    if stripped != paragraph:
        return _capitalize(stripped)
    return _OTHER_LABEL.sub(r"**\1:** ", paragraph, count=1)


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


def unwrap(paragraph: str) -> str:
    """Join hard-wrapped lines (GitHub renders newlines as breaks); list
    items and their continuation lines stay items."""
    out: list[str] = []
    for line in paragraph.split("\n"):
        stripped = line.strip()
        if not out or _LIST_ITEM.match(stripped):
            out.append(stripped)
        else:
            out[-1] += " " + stripped
    return "\n".join(out)


def commit_message(header: PatchHeader) -> str:
    """Subject, blank line, the description as written (already wrapped)."""
    body = header.description.split("\n", 1)
    text = header.subject + "\n\n" + body[0].strip() + "\n"
    if len(body) > 1 and body[1].strip():
        text += "\n" + body[1].strip("\n") + "\n"
    return text


@dataclass(frozen=True)
class FileChange:
    path: str
    added: int
    removed: int
    functions: list[str]  # hunk section headers, in order, unique
    new: bool = False


@dataclass(frozen=True)
class BodyInputs:
    header: PatchHeader
    files: list[FileChange]
    test_path: list[str]  # upstream paths of the ported test files
    test_summary: str  # first paragraph of the test module's docstring
    named: list[StackRow]  # the Tests rows: fail below, pass with
    others: list[RevertRedRow]  # other rows of the same test files
    report: RevertRedReport
    id_map: dict[str, str]  # overlay test file -> upstream test file
    base_label: str  # e.g. "vLLM 0.33.0 (4ba787ec9)"
    lint: str  # one line: what ruff ran on and its result
    ported_run: str  # one line: the ported tests' own run, or ""
    depends_on: list[str]  # "0001-x.patch (URL)" when stacked
    overlay_note: str = ""  # what "before" and "with" ran on
    guards: list[StackRow] = field(default_factory=list)  # pass on both
    below_label: str = ""  # the stack below, e.g. "vLLM 0.33.0 + 0001..0003"
    builds_on: list[str] = field(default_factory=list)  # "#62165 (URL)"
    authorship: list[str] = field(default_factory=list)  # someone else's change


def _upstream_id(test_id: str, id_map: dict[str, str]) -> str:
    path, sep, rest = test_id.partition("::")
    return id_map.get(path, path) + sep + rest


def _short_id(test_id: str, b: BodyInputs) -> str:
    """The id without its file when the PR adds a single test file."""
    full = _upstream_id(test_id, b.id_map)
    if len(b.test_path) == 1 and full.startswith(b.test_path[0] + "::"):
        return full.split("::", 1)[1]
    return full


def _links(header: PatchHeader) -> list[str]:
    labels: dict[str, list[str]] = {}
    for label, value in (
        ("Origin", header.origin),
        ("Forwarded", header.forwarded),
        ("Bug", header.bug),
    ):
        for found in _URL.findall(value):
            url = found.rstrip(").,;:'\"")
            if label not in labels.setdefault(url, []):
                labels[url].append(label)
    return [f"- {', '.join(names)}: {url}" for url, names in labels.items()]


# The checklist block of vLLM's .github/PULL_REQUEST_TEMPLATE.md: its
# heading and checkbox labels, as the template has them (docs/upstream.md).
# The body below fills each item, so each is ticked; the optional
# documentation item is left to the person opening the PR.
TEMPLATE_CHECKLIST = (
    "## Essential Elements of an Effective PR Description Checklist",
    "",
    '- [x] The purpose of the PR, such as "Fix some issue (link existing issues '
    'this PR will resolve)".',
    "- [x] The test plan, such as providing test command.",
    "- [x] The test results, such as pasting the results comparison before and "
    "after, or e2e results",
    "- [ ] (Optional) The necessary documentation update, such as updating "
    "`supported_models.md` and `examples` for a new model.",
    "",
)


def pr_body(b: BodyInputs) -> str:
    s = split_description(b.header)
    out = [*TEMPLATE_CHECKLIST, "## Purpose", "", s.purpose, ""]
    if b.authorship:
        out += ["> " + "\n>\n> ".join(b.authorship), ""]
    links = _links(b.header)
    if b.builds_on:
        out += [
            "This extends " + "; ".join(b.builds_on) + " (merge that first); the "
            "root cause below says why that change alone is not enough.",
            "",
        ]
    if b.depends_on:
        out += [
            "This change applies on top of: "
            + "; ".join(b.depends_on)
            + " (stacked: merge that first).",
            "",
        ]
    if links:
        out += ["Related:", *links, ""]
    out += ["## Root cause", ""]
    for p in s.root_cause:
        out += [unwrap(p), ""]
    out += ["## Changes", ""]
    for p in s.changes:
        out += [label_changes(unwrap(p)), ""]
    for f in b.files:
        what = "new file" if f.new else f"+{f.added} −{f.removed}"
        line = f"- `{f.path}` ({what})"
        if f.functions:
            line += ": " + ", ".join(f"`{fn}`" for fn in f.functions)
        out.append(line)
    out += ["", "## Test Plan", ""]
    if b.test_summary:
        out += [unwrap(b.test_summary), ""]
    out += ["```bash", *(f"pytest -v {p}" for p in b.test_path), "```", ""]
    out += [
        "Tests that fail before this change and pass with it:",
        *(f"- `{_short_id(r.test_id, b)}`" for r in b.named),
        "",
    ]
    if b.guards:
        out += [
            "Tests that must pass before and after it (regression guards):",
            *(f"- `{_short_id(r.test_id, b)}`" for r in b.guards),
            "",
        ]
    if b.others:
        steady = all(r.base == r.overlay == "passed" for r in b.others)
        out += [
            f"The other {count(len(b.others), 'test')} in the file "
            f"{verb(len(b.others), 'pins', 'pin')} behaviour that must not change"
            + (
                f"; {verb(len(b.others), 'it passes', 'they pass')} before and after."
                if steady
                else " (results below)."
            ),
            "",
        ]
    below = b.below_label or b.base_label
    out += ["## Test Result", ""]
    out += [
        f"Each test run on {below} and with the change (CPU, "
        f"`VLLM_TARGET_DEVICE=cpu`), report of {b.report.generated_at}:",
        "",
        f"| Test | {below} | With this change |",
        "| --- | --- | --- |",
    ]
    for r in [*b.named, *b.guards]:
        out.append(f"| `{_short_id(r.test_id, b)}` | {r.below} | {r.with_} |")
    out.append("")
    if b.others:
        out += [
            f"The other tests of the file, on {b.base_label} and with every "
            "change of the series:",
            "",
            f"| Test | {b.base_label} | With the series |",
            "| --- | --- | --- |",
            *(
                f"| `{_short_id(r.test_id, b)}` | {r.base} | {r.overlay} |"
                for r in b.others
            ),
            "",
        ]
    if b.overlay_note:
        out += [b.overlay_note, ""]
    out += [b.lint, ""]
    if b.ported_run:
        out += [b.ported_run, ""]
    return "\n".join(out).rstrip("\n") + "\n"
