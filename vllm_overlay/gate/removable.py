"""Prove a connector workaround removable with the core patch that fixes
its root cause (`vllm-overlay removable`, a gate step after revert-red).

A connector patch whose Remove-When names ``core patch cNNN`` is a
workaround for a vLLM core bug that the core series (``patches/core/``)
fixes. For each core patch the proof runs, with vLLM's MoRIIO package and
core modules loaded from materialized trees (``vllm_overlay.gate.level``):

1. the core patch's own Tests on the whole connector series without it and
   with it (the core series up to it applied): they must fail, then pass;
2. for each workaround naming it: the whole series with the workaround's
   hunks reverse-applied on top, or, where a patch above edits a line of a
   hunk's context, its change merged out as `git revert` does (a conflict,
   or a change that is not there: "does not revert"), its Tests without
   the core patch (they must fail, or the proof could not fail) and with it
   (they must pass).

The verdicts and the core patches' rows go to a JSON report
(``.nox-reports/removable.json``) that `vllm-overlay export` reads for the
core bundles.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.gate.outcomes import load_outcomes
from vllm_overlay.gate.pytestargs import rooted
from vllm_overlay.gate.pytestpool import PytestPool
from vllm_overlay.gate.reports import ReportError, TestOutcome, names
from vllm_overlay.series.core_series import core_fix, core_key
from vllm_overlay.series.diff import HunkError, apply_file_patch
from vllm_overlay.series.patch_series import Series, SeriesPatch
from vllm_overlay.series.pin import Pin
from vllm_overlay.tree.apply import ApplyError, overlay_texts
from vllm_overlay.tree.materialize import core_texts, materialize

REMOVABLE_REPORT = "removable.json"


class RemovableError(OverlayError):
    """A proof could not be run (pytest did not start or collect)."""


class CoreRow(msgspec.Struct, forbid_unknown_fields=True):
    """A core patch's named test on the series without it and with it."""

    core: str  # the core patch's file name
    test_id: str
    without: TestOutcome
    with_: TestOutcome = msgspec.field(name="with")

    @property
    def holds(self) -> bool:
        return self.without in ("failed", "error") and self.with_ == "passed"


class Verdict(msgspec.Struct, forbid_unknown_fields=True):
    workaround: str  # the connector patch's file name
    core: str  # the core patch's file name
    removable: bool
    why: str  # "" when removable

    @property
    def line(self) -> str:
        number = self.workaround.split("-", 1)[0]
        said = "yes" if self.removable else f"no ({self.why})"
        return f"{number} removable with core patch {self.core[:4]}: {said}"


class RemovableReport(msgspec.Struct, forbid_unknown_fields=True):
    series_id: str
    core_series_id: str
    vllm_version: str
    core_rows: list[CoreRow]
    verdicts: list[Verdict]
    generated_at: str = ""  # ISO 8601, UTC

    def rows_for(self, core: str) -> list[CoreRow]:
        return [r for r in self.core_rows if r.core == core]


def encode_removable(report: RemovableReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"


def load_removable(path: Path) -> RemovableReport:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ReportError(
            f"{path}: cannot read the removable report: {e.strerror}; run "
            "`vllm-overlay removable` (or `nox -s unit-base`) first"
        ) from None
    try:
        return msgspec.json.decode(data, type=RemovableReport)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ReportError(f"{path}: not a removable report ({e})") from None


class RevertError(OverlayError):
    """A workaround's change cannot be undone on the whole series."""


def reverted_texts(
    texts: dict[str, str],
    patch: SeriesPatch,
    levels: tuple[dict[str, str], dict[str, str]] | None = None,
) -> dict[str, str]:
    """``texts`` with ``patch``'s change undone: its hunks reverse-applied
    where the patches above left them. When a hunk is not found there (a
    patch above edits a line of its context) and ``levels`` gives the stack
    below ``patch`` and with it, the change from the one to the other is
    merged into ``texts`` as `git revert` does (`git merge-file`), which
    must merge without a conflict and change the file. A ``HunkError`` or a
    ``RevertError`` otherwise."""
    out = dict(texts)
    for fp in patch.files:
        try:
            out[fp.path] = apply_file_patch(
                out[fp.path], fp.reversed(), offset=True
            ).text
        except HunkError:
            if levels is None:
                raise
            below, with_ = levels
            out[fp.path] = _merge_revert(
                fp.path, out[fp.path], with_[fp.path], below[fp.path]
            )
    return out


def _merge_revert(path: str, current: str, with_: str, below: str) -> str:
    """``current`` with the change from ``with_`` to ``below`` merged in."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-revert-") as tmp:
        names = []
        for name, text in (("current", current), ("with", with_), ("below", below)):
            (Path(tmp) / name).write_text(text)
            names.append(str(Path(tmp) / name))
        done = subprocess.run(
            ["git", "merge-file", "-p", "-q", *names],
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        why = (
            f"{done.returncode} conflicts"
            if done.returncode > 0
            else done.stderr.strip() or "git merge-file failed"
        )
        raise RevertError(f"{path}: its change does not merge out: {why}")
    if done.stdout == current:
        raise RevertError(f"{path}: its change is not in the series")
    return done.stdout


# Runs pytest on a tree: (its MoRIIO files and core files, the test entries,
# a work directory) -> each test id's outcome.
Runner = Callable[[dict[str, str], Sequence[str], Path], dict[str, TestOutcome]]


def pytest_runner(
    root: Path, pin: Pin, pool: PytestPool, pytest_args: Sequence[str] = ()
) -> Runner:
    """Materialize the files, run pytest on ``entries`` in a child of
    ``pool``'s server with vLLM's MoRIIO package (and the core modules the
    files hold) loaded from them."""

    def run(
        files: dict[str, str], entries: Sequence[str], work: Path
    ) -> dict[str, TestOutcome]:
        materialize(files, Series(root, ()), work)
        outcomes = work / "outcomes.json"
        core = [p for p in files if p in pin.core_files]
        args = [
            *rooted(root),
            "-p", "no:cacheprovider", "-q", "--no-header", "-rN", "--tb=no",
            "-p", "vllm_overlay.gate.outcomes", "--outcomes-json", str(outcomes),
            "-p", "vllm_overlay.gate.level",
            "--moriio-dir", str(work / pin.module),
            *(["--core-dir", str(work)] if core else []),
            *pytest_args, *entries,
        ]  # fmt: skip
        log = work / "pytest.log"
        code = pool.run(args, log)
        if code not in (0, 1) or not outcomes.is_file():
            text = log.read_text(errors="replace") if log.is_file() else ""
            tail = [ln for ln in text.splitlines() if ln.strip()][-6:]
            raise RemovableError(f"pytest exited {code} on {work}: " + " | ".join(tail))
        return load_outcomes(outcomes)

    return run


def named_entries(inputs: Inputs) -> list[str]:
    """The test entries the proofs run: each core patch's and each
    workaround's."""
    patches = [*inputs.core.patches]
    patches += [w for w, _ in workarounds(inputs.series, inputs.core)]
    return list(dict.fromkeys(t for p in patches for t in p.header.tests))


def _outcome(outcomes: dict[str, TestOutcome], entry: str) -> list[TestOutcome]:
    found = [o for t, o in outcomes.items() if names(entry, t)]
    return found or ["not run"]


def _failing(outcomes: dict[str, TestOutcome], entries: Sequence[str]) -> list[str]:
    return [e for e in entries if any(o != "passed" for o in _outcome(outcomes, e))]


@dataclass(frozen=True)
class Inputs:
    series: Series
    core: Series
    bases: dict[str, str]  # the pinned MoRIIO base texts
    core_bases: dict[str, str]  # the pinned core base texts


def prove_core(
    inputs: Inputs, fix: SeriesPatch, run: Runner, work: Path
) -> list[CoreRow]:
    """The core patch's Tests on the whole connector series without it (the
    core patches before it applied) and with it."""
    full = {**inputs.bases, **overlay_texts(inputs.bases, inputs.series)}
    below = core_texts(inputs.core_bases, inputs.core.upto(fix.index - 1))
    above = core_texts(inputs.core_bases, inputs.core.upto(fix.index))
    tests = fix.header.tests
    without = run({**full, **below}, tests, work / f"{core_key(fix)}-without")
    with_ = run({**full, **above}, tests, work / f"{core_key(fix)}-with")
    return [
        CoreRow(fix.name, t, without.get(t, "not run"), with_.get(t, "not run"))
        for t in sorted({*without, *with_})
        if any(names(e, t) for e in tests)
    ]


def prove_workaround(
    inputs: Inputs, workaround: SeriesPatch, fix: SeriesPatch, run: Runner, work: Path
) -> Verdict:
    """Whether ``workaround`` can go once ``fix`` is in vLLM."""

    def no(why: str) -> Verdict:
        return Verdict(workaround.name, fix.name, False, why)

    full = {**inputs.bases, **overlay_texts(inputs.bases, inputs.series)}
    levels = tuple(
        {**inputs.bases, **overlay_texts(inputs.bases, inputs.series.upto(k))}
        for k in (workaround.index - 1, workaround.index)
    )
    try:
        reverted = reverted_texts(full, workaround, (levels[0], levels[1]))
    except (HunkError, RevertError, ApplyError) as e:
        return no(f"does not revert: {e}")
    tests = workaround.header.tests
    number = workaround.name.split("-", 1)[0]
    key = core_key(fix)
    below = core_texts(inputs.core_bases, inputs.core.upto(fix.index - 1))
    without = run({**reverted, **below}, tests, work / f"{number}-reverted")
    if not (red := _failing(without, tests)):
        return no(
            f"its tests pass with {number} reverted and no core patch, so the "
            "proof cannot fail"
        )
    above = core_texts(inputs.core_bases, inputs.core.upto(fix.index))
    with_ = run({**reverted, **above}, tests, work / f"{number}-reverted-{key}")
    if failing := _failing(with_, tests):
        shown = ", ".join(failing[:3]) + (" ..." if len(failing) > 3 else "")
        return no(
            f"{len(failing)} of {len(tests)} named tests fail with {number} "
            f"reverted and {key} applied: {shown}"
        )
    return Verdict(
        workaround.name,
        fix.name,
        True,
        f"{len(red)} of {len(tests)} named tests fail with {number} reverted, "
        f"all pass with {key} applied",
    )


def workarounds(series: Series, core: Series) -> list[tuple[SeriesPatch, SeriesPatch]]:
    """(workaround, core patch) for each connector patch whose Remove-When
    names a core patch the core series holds."""
    by_key = {core_key(p): p for p in core.patches}
    out = []
    for p in series.patches:
        key = core_fix(p.header)
        if key is not None and key in by_key:
            out.append((p, by_key[key]))
    return out


def prove_all(
    inputs: Inputs,
    run: Runner,
    vllm_version: str,
    progress: Callable[[str], None] = print,
    only: Sequence[str] = (),
    jobs: int = 0,
) -> RemovableReport:
    """Every core patch's rows and every workaround's verdict (``only``:
    the workarounds named, by number or file name, and their core patches).
    The proofs are independent: ``jobs`` of them run at a time (0: one per
    core), each in its own work directory; rows and verdicts keep the
    series' order."""
    pairs = [
        (w, f)
        for w, f in workarounds(inputs.series, inputs.core)
        if not only or {w.name, w.name.split("-", 1)[0], w.slug} & set(only)
    ]
    fixes = [f for f in inputs.core.patches if not only or f in [p for _, p in pairs]]
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-removable-") as tmp:
        work = Path(tmp)

        def core_proof(fix: SeriesPatch) -> list[CoreRow]:
            progress(
                f"removable: core patch {fix.name}: its named tests without it "
                "and with it, on the whole connector series"
            )
            mine = prove_core(inputs, fix, run, work)
            held = sum(r.holds for r in mine)
            progress(
                f"removable: core patch {core_key(fix)}: {held} of {len(mine)} "
                "named tests fail without it and pass with it"
            )
            return mine

        def workaround_proof(pair: tuple[SeriesPatch, SeriesPatch]) -> Verdict:
            workaround, fix = pair
            progress(
                f"removable: {workaround.name}: reverted on the whole series, its "
                f"named tests without and with core patch {core_key(fix)}"
            )
            return prove_workaround(inputs, workaround, fix, run, work)

        workers = max(1, jobs or os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            core_runs = [pool.submit(core_proof, fix) for fix in fixes]
            workaround_runs = [pool.submit(workaround_proof, p) for p in pairs]
            rows = [row for f in core_runs for row in f.result()]
            verdicts = [f.result() for f in workaround_runs]
    return RemovableReport(
        inputs.series.series_id,
        inputs.core.series_id,
        vllm_version,
        rows,
        verdicts,
        dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
