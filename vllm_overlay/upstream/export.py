"""`vllm-overlay export`: each patch as an upstream-ready vLLM pull request.

For patch N the bundle ``dist/upstream/<nn>-<slug>/`` holds:

- ``<nn>-<slug>.patch``: a ``git format-patch`` mail (made by git) with the
  header's author, its Last-Update as date, its Subject as title and its
  Description as commit message; the diff changes the vLLM files and adds
  the patch's tests, ported to ``tests/v1/kv_connector/unit/`` with vLLM's
  SPDX header and every builder inlined (see ``testport``);
- ``PR.md``: the pull-request body (see ``prbody``), with the rows of the
  last ``nox -s unit-base`` run for the tests the header names (on the stack
  below the patch and with it) and this run's ruff result;
- ``checks.log``: every check below and its outcome.

Bundles come in stack order, one per patch. Each mail is made against the
stack below its patch (the pinned base with patches 1..N-1), so the bundles
apply with ``git am`` one after the other onto the pinned base. When a patch
also applies to the pinned base alone, the log says so; when it does not,
PR.md names the earlier patches touching the same files ("applies on top
of"). An extension of ours (``Builds-On``) names the upstream pull request it
extends.

Checks, all before anything is written, for every exported patch; one
failure stops the export with its message and writes nothing:

1. applies with zero fuzz, no offset after its predecessors;
2. the Subject is in vLLM's PR-title style ("[Tag]... Title");
3. a unit-base report exists for this very series, and every test the
   header's Tests names failed (or errored) on the stack below the patch and
   passed with it, and every Guards test passed on both;
4. the tests port (self-contained) and, with the changed vLLM files, pass
   ``ruff check`` and ``ruff format --check`` (ruff 0.14.0, vLLM's config);
5. ``git am --keep-non-patch`` of the mail onto the stack below gives
   exactly the expected files, subject and author;
6. the PR body is within GitHub's 65536 characters;
7. with ``--run-tests``: each ported file, alone in a vLLM-like test layout
   (no conftest), passes in this Python with vLLM's MoRIIO package loaded
   from the stack with the patch;
8. exporting the whole series: ``git am`` of every mail in order onto the
   pinned base gives the whole series' files.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay import cpuplatform, warm
from vllm_overlay.checkout import REPORT_DIR, Checkout
from vllm_overlay.errors import OverlayError
from vllm_overlay.gate.removable import (
    REMOVABLE_REPORT,
    RemovableReport,
    load_removable,
)
from vllm_overlay.gate.reports import (
    RevertRedReport,
    RevertRedRow,
    StackRow,
    load_revert_red,
)
from vllm_overlay.gate.reports import names as header_names
from vllm_overlay.gate.stack import level_label, named_tests
from vllm_overlay.series.core_series import core_key, load_core_series
from vllm_overlay.series.diff import Hunk, HunkError, apply_file_patch
from vllm_overlay.series.patch_series import PROJECT_NAME, Series, SeriesPatch
from vllm_overlay.series.pin import Pin
from vllm_overlay.text import count, verb
from vllm_overlay.tree.materialize import BaseSource
from vllm_overlay.upstream.gitmail import Identity, am_check, am_series, format_patch
from vllm_overlay.upstream.prbody import (
    GITHUB_BODY_LIMIT,
    BodyError,
    BodyInputs,
    FileChange,
    commit_message,
    pr_body,
    split_description,
)
from vllm_overlay.upstream.testport import (
    UPSTREAM_TEST_DIR,
    VLLM_HELPER_MODULES,
    port_test,
    upstream_test_path,
)

RUFF_VERSION = "0.14.0"
# The Author of this project's own patches (``vllm-moriio-overlay <email>``,
# patches/AUTHORS): not a person, so the mail is authored and signed off by
# whoever exports it (vLLM's DCO check wants the author's own Signed-off-by);
# without a sign-off the mail is from the project's address.
PROJECT_AUTHOR = PROJECT_NAME
# The title tags vLLM's own MoRIIO and KV-connector pull requests use
# (docs/upstream.md cites them); a title's tags come from this list.
VLLM_TITLE_TAGS = (
    "Bugfix",
    "ROCm",
    "KVConnector",
    "P/D",
    "PD",
    "MoRIIO",
    "Connector",
    "Core",
    "Feature",
    "Perf",
    "CI",
    "Misc",
)
# Tags vLLM spells otherwise.
RESPELLED_TAGS = {"KV Connector": "KVConnector", "BugFix": "Bugfix", "Bug": "Bugfix"}
VLLM_REPO = "vllm-project/vllm"
RUFF_CONFIG = "ci/ruff-vllm.toml"
DEFAULT_OUT = Path("dist/upstream")
_SUBJECT_RE = re.compile(r"^(\[[^\]\n]+\])+ \S.*$")
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class ExportError(OverlayError):
    """A check failed; nothing was written."""


@dataclass
class Bundle:
    patch: SeriesPatch
    mail: str
    body: str
    log: list[str] = field(default_factory=list)
    # The earlier patches whose mails are applied first (slugs).
    first: list[str] = field(default_factory=list)

    @property
    def dirname(self) -> str:
        return self.patch.slug


@dataclass(frozen=True)
class Ruff:
    exe: str
    config: Path

    def run(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.exe, *args, "--config", str(self.config), "--no-cache"],
            capture_output=True,
            text=True,
            cwd=cwd,
        )


def find_ruff(explicit: str | None, config: Path) -> Ruff:
    config = config.resolve()
    if not config.is_file():
        raise ExportError(f"{config}: vLLM's ruff configuration is missing")
    candidates = [explicit or os.environ.get("VLLM_OVERLAY_RUFF")]
    if not candidates[0]:
        candidates += [str(Path(sys.executable).parent / "ruff"), shutil.which("ruff")]
    for exe in candidates:
        if exe and Path(exe).is_file():
            run = subprocess.run([exe, "--version"], capture_output=True, text=True)
            version = run.stdout.strip()
            if version != f"ruff {RUFF_VERSION}":
                raise ExportError(
                    f"{exe} is {version or 'not runnable'}; export needs ruff "
                    f"{RUFF_VERSION} (pip install ruff=={RUFF_VERSION}, or --ruff)"
                )
            return Ruff(exe, config)
    raise ExportError(f"ruff {RUFF_VERSION} not found; pass --ruff PATH")


def _fail(patch: SeriesPatch, log: list[str], message: str) -> ExportError:
    log.append(f"[FAIL] {message}")
    return ExportError(f"{patch.name}: {message}; nothing was written")


def _apply(texts: dict[str, str], patch: SeriesPatch) -> dict[str, str]:
    out = dict(texts)
    for fp in patch.files:
        out[fp.path] = apply_file_patch(out[fp.path], fp).text
    return out


def _revert_red_rows(
    ctx: Context, patch: SeriesPatch, log: list[str]
) -> tuple[list[StackRow], list[StackRow], list[RevertRedRow]]:
    """Check 3: the patch's Tests rows, its Guards rows (both proven on the
    stack below it), and the other rows of the test files it names."""
    report = ctx.report
    rows = report.stack_for(patch.name)
    below = level_label(ctx.series, patch.index - 1)
    problems = [
        f"{named} is not in the report"
        for named in named_tests(patch)
        if not any(header_names(named, r.test_id) for r in rows)
    ]
    for r in rows:
        if not r.holds:
            what = "guard " if r.role == "guard" else ""
            problems.append(f"{what}{r.test_id}: {r.below} below, {r.with_} with it")
    if problems:
        raise _fail(
            patch,
            log,
            "the unit-base report does not show the named tests failing on the "
            f"stack below ({below}) and passing with the patch, or its guards "
            "passing on both (" + "; ".join(problems[:5]) + "); run "
            "`nox -s unit-base` again or fix the header",
        )
    named = [r for r in rows if r.role == "test"]
    guards = [r for r in rows if r.role == "guard"]
    files = {t.split("::", 1)[0] for t in patch.header.tests}
    seen = {r.test_id for r in rows}
    others = [
        r
        for r in report.rows
        if r.test_id.split("::", 1)[0] in files and r.test_id not in seen
    ]
    foreign = sorted({f"{r.test_id} ({r.patch})" for r in others if r.patch})
    if foreign:
        raise _fail(
            patch,
            log,
            "its test file also holds tests another patch names, which would "
            "fail upstream without that patch: " + ", ".join(foreign[:3]),
        )
    log.append(
        f"[ok] revert-red: {count(len(named), 'named test')} "
        f"{verb(len(named), 'fails', 'fail')} on {below} and "
        f"{verb(len(named), 'passes', 'pass')} with the patch; "
        f"{count(len(guards), 'guard')} {verb(len(guards), 'passes', 'pass')} on "
        f"both (unit-base report "
        f"{report.generated_at})"
    )
    return named, guards, others


def core_test_path(test_file: Path) -> str:
    """``tests/patches/core/test_c001_sync_load.py`` ->
    ``tests/v1/kv_connector/unit/test_sync_load.py``: a core patch's tests
    drive the scheduler through a connector, as vLLM's connector unit tests
    do, with their helpers (``utils.py``)."""
    stem = re.sub(r"^c\d{3}_", "", test_file.stem.removeprefix("test_"))
    return f"{UPSTREAM_TEST_DIR}/test_{stem}.py"


def _port(
    root: Path,
    patch: SeriesPatch,
    ruff: Ruff,
    log: list[str],
    dest_of: Callable[[Path], str] = upstream_test_path,
) -> tuple[dict[str, str], dict[str, str], str]:
    """Ported test texts by upstream path, the id map, the test summary."""
    files = sorted({t.split("::", 1)[0] for t in patch.header.tests})
    ported: dict[str, str] = {}
    id_map: dict[str, str] = {}
    summary = ""
    for rel in files:
        src = root / rel
        if not src.is_file():
            raise _fail(patch, log, f"Tests names {rel}, which does not exist")
        try:
            raw = port_test(src)
        except OverlayError as e:
            raise _fail(patch, log, f"cannot port {rel}: {e}") from None
        dest = dest_of(src)
        with tempfile.TemporaryDirectory(prefix="vllm-overlay-port-") as tmp:
            f = Path(tmp) / "port.py"
            f.write_text(raw)
            for args in (
                ("check", "--select", "I,F401", "--fix", "-q", str(f)),
                ("format", "-q", str(f)),
            ):
                run = ruff.run(*args, cwd=Path(tmp))
                if run.returncode != 0:
                    out = (run.stdout + run.stderr).strip()
                    raise _fail(
                        patch, log, f"ruff {args[0]} on the port of {rel}: {out}"
                    )
            ported[dest] = f.read_text()
        id_map[rel] = dest
        doc = ast.get_docstring(ast.parse(ported[dest])) or ""
        if not summary and doc:
            summary = re.sub(r"^Patch \d{4}:\s*", "", doc.split("\n\n", 1)[0])
            summary = summary[:1].upper() + summary[1:]
        tests = [
            n.name
            for n in ast.parse(ported[dest]).body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
        ]
        log.append(f"[ok] ported {rel} -> {dest} ({len(tests)} test functions)")
    return ported, id_map, summary


def _lint(patch: SeriesPatch, files: dict[str, str], ruff: Ruff, log: list[str]) -> str:
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-lint-") as tmp:
        for path, text in files.items():
            dest = Path(tmp) / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        names = sorted(files)
        for args in (("check",), ("format", "--check")):
            extra = ("--output-format", "concise") if args == ("check",) else ()
            run = ruff.run(*args, *extra, *names, cwd=Path(tmp))
            out = (run.stdout + run.stderr).strip()
            if run.returncode != 0:
                found = "; ".join(out.splitlines()[:6])
                raise _fail(patch, log, f"ruff {' '.join(args)} fails: {found}")
            log.append(f"[ok] ruff {RUFF_VERSION} {' '.join(args)}: {out}")
    listed = ", ".join(f"`{n}`" for n in names)
    return (
        f"Lint: ruff {RUFF_VERSION} with vLLM's ruff settings, `ruff check` and "
        f"`ruff format --check` on {listed}: both pass."
    )


_DEF_RE = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)")


def _first_change(hunk: Hunk) -> int:
    """Lines of the new side before the hunk's first changed line."""
    k = 0
    for tag, _ in hunk.lines:
        if tag != " ":
            return k
        k += 1
    return k


def _enclosing_def(lines: list[str], at: int) -> str:
    """The def or class line ``at`` is, or the innermost one holding it."""
    at = min(at, len(lines) - 1)
    while at > 0 and not lines[at].strip():
        at -= 1
    if at < 0:
        return ""
    m = _DEF_RE.match(lines[at])
    if m:
        return m.group(1)
    indent = len(lines[at]) - len(lines[at].lstrip())
    for i in range(at - 1, -1, -1):
        line = lines[i]
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth < indent:
            m = _DEF_RE.match(line)
            if m:
                return m.group(1)
            indent = depth
    return ""


def _file_changes(
    patch: SeriesPatch, after: dict[str, str], new: list[str]
) -> list[FileChange]:
    out = []
    for fp in patch.files:
        added = sum(1 for h in fp.hunks for tag, _ in h.lines if tag == "+")
        removed = sum(1 for h in fp.hunks for tag, _ in h.lines if tag == "-")
        functions = []
        lines = after[fp.path].splitlines()
        for h in fp.hunks:
            name = _enclosing_def(lines, h.new_start - 1 + _first_change(h))
            if name and name not in functions:
                functions.append(name)
        out.append(FileChange(fp.path, added, removed, functions))
    out += [FileChange(p, after[p].count("\n"), 0, [], new=True) for p in new]
    return out


def _run_ported(
    ctx: Context,
    patch: SeriesPatch,
    after: dict[str, str],
    ported: dict[str, str],
    log: list[str],
) -> str:
    """Check 7: the ported files run alone, with vLLM's MoRIIO package
    loaded from the stack with the patch (``after``: every pinned file)."""
    standins = _helper_standins(ctx.root, patch, ported)
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-upstream-tests-") as tmp:
        tree, level = Path(tmp) / "tree", Path(tmp) / "level"
        for root, files in ((tree, {**ported, **standins}), (level, after)):
            for path, text in files.items():
                dest = root / path
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(text)
        env = cpuplatform.cpu_environ()
        cmd = [*warm.python_command(env), "-m", "pytest", "-q"]
        cmd += ["-p", "no:cacheprovider"]
        cmd += ["-p", "vllm_overlay.gate.level"]
        cmd += ["--moriio-dir", str(level / ctx.pin.module)]
        cmd += ["--rootdir", str(tree), *sorted(ported)]
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    tail = [ln for ln in run.stdout.strip().splitlines() if ln.strip()][-1:]
    summary = tail[0].strip("= ") if tail else f"exit {run.returncode}"
    if run.returncode != 0:
        raise _fail(patch, log, f"the ported tests fail in isolation: {summary}")
    stood_in = [p for p in standins if not p.endswith("__init__.py")]
    log.append(
        f"[ok] ported tests ran alone (no conftest) on "
        f"{level_label(ctx.series, patch.index)}: {summary}"
        + (
            f" (vLLM's {', '.join(stood_in)} stood in by this repository's "
            "module of the same names: vLLM's test tree is not in the wheel)"
            if stood_in
            else ""
        )
    )
    return f"The ported test file, run alone in vLLM's test layout: {summary}."


def _helper_standins(
    root: Path, patch: SeriesPatch, ported: dict[str, str]
) -> dict[str, str]:
    """For a run outside vLLM's tree: the modules of vLLM's test tree the
    ports import (``from .utils import ...``), each from the local module
    that stands in for it, and the ``__init__.py`` files that make the
    relative import resolve."""
    dirs = sorted({(root / t.split("::", 1)[0]).parent for t in patch.header.tests})
    out: dict[str, str] = {}
    for local, upstream in VLLM_HELPER_MODULES.items():
        if not any(f"from .{upstream} import" in t for t in ported.values()):
            continue
        src = next(d / f"{local}.py" for d in dirs if (d / f"{local}.py").is_file())
        out[f"{UPSTREAM_TEST_DIR}/{upstream}.py"] = src.read_text()
    if out:
        parts = Path(UPSTREAM_TEST_DIR).parts
        for i in range(1, len(parts) + 1):
            out[str(Path(*parts[:i]) / "__init__.py")] = ""
    return out


@dataclass(frozen=True)
class Context:
    root: Path
    pin: Pin
    series: Series
    bases: dict[str, str]
    base_source: str
    report: RevertRedReport
    ruff: Ruff
    run_tests: bool
    # Who signs the mails off (Signed-off-by); None: no sign-off.
    signoff: Identity | None = None
    # The core series (patches/core/), its pinned base files and the
    # `vllm-overlay removable` report proving it; empty without one.
    core: Series | None = None
    core_bases: dict[str, str] = field(default_factory=dict)
    removable: RemovableReport | None = None


@dataclass(frozen=True)
class _Trees:
    """The vLLM files the mail goes from (``before``) and to (``after``)."""

    before: dict[str, str]
    after: dict[str, str]
    depends: list[str]  # the patches touching the same files, when needed
    first: list[str]  # the slugs of the mails to apply first


_PR_URL_RE = re.compile(r"^https://github\.com/vllm-project/vllm/pull/(\d+)$")


def _pr_ref(url: str) -> str:
    """``#62165 (URL)`` for a vLLM pull request, else the URL."""
    m = _PR_URL_RE.match(url)
    return f"#{m.group(1)} ({url})" if m else url


def _builds_on(ctx: Context, patch: SeriesPatch) -> list[str]:
    """The upstream pull requests an extension builds on, with their patch."""
    out = []
    for url in patch.header.builds_on:
        owner = next(
            (p for p in ctx.series.patches if p.header.upstream_url == url), None
        )
        out.append(_pr_ref(url) + (f" ({owner.name})" if owner else ""))
    return out


def build_bundle(ctx: Context, patch: SeriesPatch) -> Bundle:
    log = [
        f"export {patch.name} (series {ctx.series.series_id}, vLLM "
        f"{ctx.pin.vllm.version} {ctx.pin.vllm.git_commit}, base from "
        f"{ctx.base_source})"
    ]
    trees = _trees(ctx, patch, log)
    _check_header(patch, log)
    named, guards, others = _revert_red_rows(ctx, patch, log)
    ported, id_map, summary = _port(ctx.root, patch, ctx.ruff, log)
    for r in guards:  # a guard may live in an earlier patch's test file
        rel = r.test_id.split("::", 1)[0]
        id_map.setdefault(rel, upstream_test_path(ctx.root / rel))
    changed = {fp.path: trees.after[fp.path] for fp in patch.files}
    lint = _lint(patch, {**changed, **ported}, ctx.ruff, log)
    pr_after = {**changed, **ported}
    below = level_label(ctx.series, patch.index - 1)
    before = {p: trees.before[p] for p in changed}
    mail = _mail(patch, before, pr_after, below, log, ctx.signoff)
    ported_run = ""
    if ctx.run_tests:
        ported_run = _run_ported(ctx, patch, trees.after, ported, log)
    else:
        log.append("[--] ported tests not run alone (--run-tests not given)")
    predecessors = ctx.series.patches[: patch.index - 1]
    note = ""
    if predecessors:
        note = (
            f"Before: vLLM {ctx.pin.vllm.version} with the MoRIIO changes below "
            "this one in the series applied ("
            + ", ".join(p.name for p in predecessors)
            + "); with: this change added."
        )
    base_label = f"vLLM {ctx.pin.vllm.version} ({ctx.pin.vllm.git_commit})"
    body = pr_body(
        BodyInputs(
            header=patch.header,
            files=_file_changes(patch, pr_after, sorted(ported)),
            test_path=sorted(ported),
            test_summary=summary,
            named=named,
            others=others,
            report=ctx.report,
            id_map=id_map,
            base_label=base_label,
            lint=lint,
            ported_run=ported_run,
            depends_on=trees.depends,
            overlay_note=note,
            guards=guards,
            below_label=base_label + below.removeprefix("base"),
            builds_on=_builds_on(ctx, patch),
            authorship=authorship_note(patch, mail_author(patch, ctx.signoff)),
        )
    )
    _check_body(patch, body, log)
    return Bundle(patch, mail, body, log, trees.first)


def _core_rows(ctx: Context, patch: SeriesPatch, log: list[str]) -> list[StackRow]:
    """Check 3 for a core patch: the removable report shows its named tests
    failing on the whole connector series without it and passing with it."""
    assert ctx.removable is not None
    rows = ctx.removable.rows_for(patch.name)
    problems = [
        f"{named} is not in the report"
        for named in patch.header.tests
        if not any(header_names(named, r.test_id) for r in rows)
    ]
    problems += [
        f"{r.test_id}: {r.without} without it, {r.with_} with it"
        for r in rows
        if not r.holds
    ]
    if problems:
        raise _fail(
            patch,
            log,
            "the removable report does not show its named tests failing without "
            "it and passing with it (" + "; ".join(problems[:5]) + "); run "
            "`vllm-overlay removable` again or fix the header",
        )
    log.append(
        f"[ok] revert-red: {count(len(rows), 'named test')} "
        f"{verb(len(rows), 'fails', 'fail')} on vLLM {ctx.pin.vllm.version} with "
        f"the connector series and without the core patch, and "
        f"{verb(len(rows), 'passes', 'pass')} with it (removable report "
        f"{ctx.removable.generated_at})"
    )
    return [StackRow(r.test_id, patch.name, "test", r.without, r.with_) for r in rows]


def build_core_bundle(ctx: Context, patch: SeriesPatch) -> Bundle:
    """A core patch as its own pull request against the pinned vLLM: the
    mail goes from the pinned core files (with the core patches before it)
    to the files with it, its tests ported to vLLM's connector unit tests."""
    assert ctx.core is not None and ctx.removable is not None
    log = [
        f"export core patch {patch.name} (core series {ctx.core.series_id}, vLLM "
        f"{ctx.pin.vllm.version} {ctx.pin.vllm.git_commit}, base from "
        f"{ctx.base_source})"
    ]
    before = dict(ctx.core_bases)
    for p in ctx.core.patches[: patch.index - 1]:
        before = _apply(before, p)
    try:
        after = _apply(before, patch)
    except HunkError as e:
        raise _fail(patch, log, f"does not apply to the pinned vLLM: {e}") from None
    log.append("[ok] applies to the pinned vLLM's core files (zero fuzz, no offset)")
    _check_header(patch, log)
    named = _core_rows(ctx, patch, log)
    ported, id_map, summary = _port(
        ctx.root, patch, ctx.ruff, log, dest_of=core_test_path
    )
    changed = {fp.path: after[fp.path] for fp in patch.files}
    lint = _lint(patch, {**changed, **ported}, ctx.ruff, log)
    pr_after = {**changed, **ported}
    mail = _mail(
        patch, {p: before[p] for p in changed}, pr_after, "base", log, ctx.signoff
    )
    log.append("[--] ported tests not run alone (a core patch's run is `removable`)")
    base_label = f"vLLM {ctx.pin.vllm.version} ({ctx.pin.vllm.git_commit})"
    verdicts = [v.line for v in ctx.removable.verdicts if v.core == patch.name]
    note = (
        f"Before: {base_label} with the MoRIIO connector changes of "
        f"vllm-moriio-overlay (series {ctx.series.series_id}) applied; with: "
        "this change added. The connector workarounds it makes unneeded, each "
        "reverted and its tests run with this change: " + "; ".join(verdicts)
        if verdicts
        else ""
    )
    body = pr_body(
        BodyInputs(
            header=patch.header,
            files=_file_changes(patch, pr_after, sorted(ported)),
            test_path=sorted(ported),
            test_summary=summary,
            named=named,
            others=[],
            report=RevertRedReport(
                ctx.pin.vllm.version,
                ctx.series.series_id,
                ctx.removable.generated_at,
                [],
                named,
            ),
            id_map=id_map,
            base_label=base_label,
            lint=lint,
            ported_run="",
            depends_on=[],
            overlay_note=note,
            authorship=authorship_note(patch, mail_author(patch, ctx.signoff)),
        )
    )
    _check_body(patch, body, log)
    return Bundle(patch, mail, body, log)


def _trees(ctx: Context, patch: SeriesPatch, log: list[str]) -> _Trees:
    """Check 1: the patch applies after its predecessors; the mail goes from
    the stack below it to the stack with it. Whether it also applies to the
    pinned base alone is logged; when it does not, the earlier patches
    touching its files are named."""
    predecessors = ctx.series.patches[: patch.index - 1]
    before = dict(ctx.bases)
    for p in predecessors:
        before = _apply(before, p)
    try:
        after = _apply(before, patch)
    except HunkError as e:
        raise _fail(patch, log, f"does not apply after its predecessors: {e}") from None
    if predecessors:
        log.append("[ok] applies after its predecessors (zero fuzz, no offset)")
    depends: list[str] = []
    try:
        _apply(ctx.bases, patch)
        log.append("[ok] applies to the pinned base alone as well")
    except HunkError as e:
        touched = {fp.path for fp in patch.files}
        deps = [p for p in predecessors if touched & {fp.path for fp in p.files}]
        log.append(
            f"[ok] applies only after {', '.join(p.name for p in deps)} (alone: {e})"
        )
        depends = [
            p.name + (f" ({p.header.upstream_url})" if p.header.upstream_url else "")
            for p in deps
        ]
    log.append(
        "[ok] the mail is made against the stack below: "
        + level_label(ctx.series, patch.index - 1)
    )
    # Not alone: the mails of every earlier patch first, in stack order (each
    # is made against the stack below it).
    first = [p.slug for p in predecessors] if depends else []
    return _Trees(before, after, depends, first)


def _check_header(patch: SeriesPatch, log: list[str]) -> None:
    """Check 2: the subject is a vLLM PR title; the date and description
    hold what the mail and the body need."""
    h = patch.header
    if not _SUBJECT_RE.match(h.subject):
        raise _fail(patch, log, f"title {h.subject!r} is not '[Tag]... Title'")
    if problem := title_tag_problem(h.subject):
        raise _fail(patch, log, problem)
    log.append("[ok] title in vLLM PR-title style, with vLLM's own tags")
    if not _DATE_RE.match(h.last_update):
        raise _fail(patch, log, "Last-Update (YYYY-MM-DD) is needed as the date")
    try:
        split_description(h)
    except BodyError as e:
        raise _fail(patch, log, str(e)) from None


def title_tag_problem(title: str) -> str | None:
    """Why the title's ``[Tag]`` prefixes are not vLLM's, None when they are."""
    tags = re.findall(r"\[([^\]\n]+)\]", title.split("] ")[0] + "]")
    for tag in tags:
        if tag in RESPELLED_TAGS:
            return f"title tag [{tag}]: vLLM writes [{RESPELLED_TAGS[tag]}]"
        if tag not in VLLM_TITLE_TAGS:
            return (
                f"title tag [{tag}] is not one vLLM's MoRIIO and KV-connector "
                f"pull requests use ({', '.join(VLLM_TITLE_TAGS)})"
            )
    return None


def is_project_patch(patch: SeriesPatch) -> bool:
    return patch.header.author.partition("<")[0].strip() == PROJECT_AUTHOR


def mail_author(patch: SeriesPatch, signoff: Identity | None) -> Identity:
    """The header's Author; for this project's own patches, the person who
    signs the mail off (else the project's address, the header's)."""
    if is_project_patch(patch) and signoff is not None:
        return signoff
    return Identity.parse(patch.header.author)


def authorship_note(patch: SeriesPatch, author: Identity) -> list[str]:
    """For someone else's change: whose it is, what the mail's address is
    (and is not), and that the sign-off is theirs to give."""
    if is_project_patch(patch):
        return []
    h = patch.header
    lines = [
        f"Authorship: this change is {author.name}'s ({h.origin}); the mail "
        f"keeps them as its author, and vLLM's DCO check wants their own "
        f"Signed-off-by, which no one else can give: the pull request is "
        f"theirs to open"
        + (f" ({h.upstream_url})" if h.upstream_url else "")
        + ", or to sign off."
    ]
    if author.email == f"{author.name}@users.noreply.github.com":
        lines.append(
            f"Address: {author.email} is derived from the GitHub handle "
            "(the form of accounts made before July 2017). Newer accounts "
            "commit as ID+handle@users.noreply.github.com, with their numeric "
            "account ID, which this export does not know and does not make up: "
            "the author amends the commit with their own address "
            "(git commit --amend --reset-author -s)."
        )
    return lines


def _mail(
    patch: SeriesPatch,
    before: dict[str, str],
    after: dict[str, str],
    below: str,
    log: list[str],
    signoff: Identity | None,
) -> str:
    """Check 5: the `git format-patch` mail, and `git am` of it onto the
    stack below gives exactly the after files, subject, author and
    sign-off."""
    h = patch.header
    author = mail_author(patch, signoff)
    date = f"{h.last_update}T00:00:00+00:00"
    mail = format_patch(before, after, author, date, commit_message(h), signoff)
    am = am_check(before, mail, sorted(after))
    want = [str(signoff)] if signoff else []
    if (
        am.files != after
        or am.subject != h.subject
        or am.author != str(author)
        or am.signoffs[-1:] != want
    ):
        raise _fail(patch, log, "git am of the mail does not give the expected tree")
    log.append(f"[ok] git am --keep-non-patch onto {below}: exact tree")
    if signoff is None:
        log.append(
            "[--] no Signed-off-by (--no-signoff): vLLM's DCO check fails until "
            "the author signs the commit off (git commit --amend -s)"
        )
    elif str(signoff) == str(author):
        log.append(f"[ok] DCO: Signed-off-by: {signoff}, the mail's author")
    else:
        log.append(
            f"[ok] Signed-off-by: {signoff}; vLLM's DCO check also wants the "
            f"author's own sign-off ({author}), so a pull request of this "
            f"change is theirs to open"
            + (f": {h.upstream_url}" if h.upstream_url else "")
        )
    log.extend(f"[--] {line}" for line in authorship_note(patch, author))
    return mail


def _check_body(patch: SeriesPatch, body: str, log: list[str]) -> None:
    """Check 6: GitHub takes the body."""
    if len(body) > GITHUB_BODY_LIMIT:
        raise _fail(
            patch,
            log,
            f"the PR body is {len(body)} characters, over {GITHUB_BODY_LIMIT}",
        )
    log.append(f"[ok] PR body {len(body)} characters (limit {GITHUB_BODY_LIMIT})")


def open_hint(pin: Pin, bundle: Bundle, out: Path) -> list[str]:
    """The commands that open the pull request from a vLLM clone, with the
    bundle's absolute paths."""
    out = out.resolve()
    slug = bundle.patch.slug
    branch = f"moriio/{slug.split('-', 1)[-1]}"
    mails = [out / s / f"{s}.patch" for s in (*bundle.first, slug)]
    lines = [
        f"open it, in a clone of https://github.com/{VLLM_REPO} with your fork "
        "as a remote:",
        f"  git checkout -b {branch} {pin.vllm.git_commit}",
    ]
    if bundle.first:
        lines.append(
            "  # it applies only on top of the earlier patches: their mails "
            "first (export them too)"
        )
    lines += [f"  git am --keep-non-patch {m}" for m in mails]
    title = shlex.quote(bundle.patch.header.subject)
    lines += [
        f"  git push -u <your-fork> {branch}",
        f"  gh pr create --repo {VLLM_REPO} --title {title} "
        f"--body-file {out / slug / 'PR.md'}",
    ]
    return lines


def load_context(
    checkout: Checkout,
    base: BaseSource,
    *,
    ruff: str | None,
    run_tests: bool,
    signoff: Identity | None = None,
) -> Context:
    root = checkout.root
    pin, series = checkout.pin, checkout.series
    if not series.patches:
        raise ExportError("the series is empty: nothing to export")
    report_path = checkout.unit_base_report
    report = load_revert_red(report_path)
    if report.series_id != series.series_id:
        raise ExportError(
            f"{report_path} is for series {report.series_id}, not "
            f"the current {series.series_id}; run `nox -s unit-base` first"
        )
    if report.vllm_version != pin.vllm.version:
        raise ExportError(
            f"{report_path} was run on vLLM {report.vllm_version}, "
            f"the pin is {pin.vllm.version}; run `nox -s unit-base` first"
        )
    bases = base.load(pin, series)
    ruff_exe = find_ruff(ruff, root / RUFF_CONFIG)
    core = load_core_series(root)
    removable = None
    if core.patches:
        path = root / REPORT_DIR / REMOVABLE_REPORT
        try:
            removable = load_removable(path)
        except OverlayError as e:
            raise ExportError(str(e)) from None
        if (removable.series_id, removable.core_series_id) != (
            series.series_id,
            core.series_id,
        ):
            raise ExportError(
                f"{path} is for series {removable.series_id} and core series "
                f"{removable.core_series_id}, not the current {series.series_id} "
                f"and {core.series_id}; run `vllm-overlay removable` first"
            )
    return Context(
        root,
        pin,
        series,
        bases.texts,
        bases.source,
        report,
        ruff_exe,
        run_tests,
        signoff,
        core,
        base.load_core(pin) if core.patches else {},
        removable,
    )


def _check_stack(ctx: Context, bundles: list[Bundle]) -> None:
    """Check 8: every mail, in order, with git am onto the pinned base gives
    the whole series' files (each mail applies onto the stack below it)."""
    whole = dict(ctx.bases)
    for p in ctx.series.patches:
        whole = _apply(whole, p)
    touched = ctx.series.touched_paths()
    try:
        files = am_series(
            {path: ctx.bases[path] for path in touched},
            [b.mail for b in bundles],
            touched,
        )
    except OverlayError as e:
        raise ExportError(
            f"the bundles do not apply in stack order: {e}; nothing was written"
        ) from None
    wrong = [path for path in touched if files[path] != whole[path]]
    if wrong:
        raise ExportError(
            "git am of every bundle in order gives other files than the series: "
            f"{', '.join(wrong)}; nothing was written"
        )
    line = (
        f"[ok] git am of bundles 1..{len(bundles)} in order onto the pinned base "
        "gives the whole series"
    )
    for b in bundles:
        b.log.append(line)


def export(ctx: Context, names: Sequence[str], out: Path) -> list[Path]:
    """Check every selected patch, then write the bundles (all or none)."""
    # A patch is named by its file name, its slug or its number ("0009", the
    # file's, not its place in the series); a core patch by its file name,
    # its slug or its key ("c001").
    keys = [{p.name, p.slug, p.name.split("-", 1)[0]} for p in ctx.series.patches]
    core = ctx.core.patches if ctx.core is not None else ()
    core_keys = [{p.name, p.slug, core_key(p)} for p in core]
    wanted = set(names)
    chosen = [
        p
        for p, k in zip(ctx.series.patches, keys, strict=True)
        if not names or k & wanted
    ]
    chosen_core = [
        p for p, k in zip(core, core_keys, strict=True) if not names or k & wanted
    ]
    unknown = wanted.difference(*keys, *core_keys)
    if unknown:
        raise ExportError(
            f"not in the series: {', '.join(sorted(unknown))} (the series: "
            f"{', '.join(p.slug for p in (*ctx.series.patches, *core))})"
        )
    # A bundle's checks wait on git, ruff and pytest much of the time: one
    # bundle per core at a time; the first failure in series order is raised.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        bundles = list(pool.map(lambda p: build_bundle(ctx, p), chosen))
    if len(chosen) == len(ctx.series.patches):
        _check_stack(ctx, bundles)
    bundles += [build_core_bundle(ctx, p) for p in chosen_core]
    written = []
    for b in bundles:
        b.log += open_hint(ctx.pin, b, out)
        d = out / b.dirname
        d.mkdir(parents=True, exist_ok=True)
        for name, text in (
            (f"{b.dirname}.patch", b.mail),
            ("PR.md", b.body),
            ("checks.log", "\n".join(b.log) + "\n"),
        ):
            (d / name).write_text(text)
            written.append(d / name)
    return written
