"""`vllm-overlay levels` and `vllm-overlay revert-red`: the proof that each
patch's tests need it, on the stack below it."""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile
import time
from pathlib import Path

from vllm_overlay.command import App, Subparsers, add_command
from vllm_overlay.errors import OverlayError
from vllm_overlay.gate.evidence import (
    Selection,
    Touches,
    encode,
    load_selection,
    load_touches,
    select,
)
from vllm_overlay.gate.outcomes import load_outcomes
from vllm_overlay.gate.pytestpool import PytestPool
from vllm_overlay.gate.ramtmp import run_tmpdir
from vllm_overlay.gate.removable import (
    REMOVABLE_REPORT,
    Inputs,
    encode_removable,
    named_entries,
    prove_all,
    pytest_runner,
    workarounds,
)
from vllm_overlay.gate.reports import TestOutcome, encode_report, names
from vllm_overlay.gate.revert_red import (
    build_report,
    evidence_problems,
    format_table,
    gate,
    series_level_note,
)
from vllm_overlay.gate.sequence import (
    EXPORT_PREFIX,
    OLD_WHEEL_ENV,
    WHEEL_ENV,
    Dirs,
    Step,
    command_line,
    prepare,
    run_step,
    run_steps,
    steps,
)
from vllm_overlay.gate.shards import (
    IDS,
    TIMES,
    TOUCHES,
    load_file_seconds,
    load_times,
    plan,
    run_shards,
    test_files,
    weigh,
)
from vllm_overlay.gate.stack import (
    LEVEL_OUTCOMES,
    level_plan,
    named_tests,
    preload_names,
    run_levels,
)
from vllm_overlay.series.core_series import load_core_series
from vllm_overlay.series.patch_series import Series
from vllm_overlay.text import count
from vllm_overlay.tree.baseopts import add_base_options, base_source


def cmd_levels(app: App, args: argparse.Namespace) -> int:
    """Run each patch's named tests on the stack levels between base and series.

    For each level K between the pinned base and the whole series (patches
    1..K applied), write the MoRIIO files once and run there, with vLLM's
    MoRIIO package loaded from them, the tests that patch K and patch K+1
    name (Tests and Guards). The outcomes go to OUT/outcomes-level-K.json
    for `revert-red --levels OUT`.
    """
    checkout = app.checkout
    series = checkout.series
    bases = base_source(args).load(checkout.pin, series)
    plan = level_plan(series)
    app.say(
        f"levels: {len(plan)} intermediate stack levels of series "
        f"{series.series_id}, base files from {bases.source}"
    )
    written = run_levels(
        checkout.root,
        checkout.pin,
        series,
        bases.texts,
        args.out,
        pytest_args=shlex.split(args.pytest_args),
        progress=app.say,
        jobs=args.jobs,
    )
    app.say(f"levels: {len(written)} levels run; outcomes in {args.out}")
    app.result({k: str(path) for k, path in written.items()})
    return 0


SELECTION = "selection.json"
# Untouched tests run on the base too, as a check of the evidence: cheap ones.
SAMPLE = 24
SAMPLE_MAX_SECONDS = 2.0


def _reasons(tests: dict[str, list[str]]) -> str:
    kinds: dict[str, int] = {}
    for why in tests.values():
        for kind in dict.fromkeys(w.split(" ", 1)[0] for w in why):
            kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))


def below_first(touches: Touches, series: Series) -> Touches:
    """The first patch's named tests are proven below it on the base run
    (stack level 0): they run there whatever they read."""
    if not series.patches:
        return touches
    named = named_tests(series.patches[0])
    tests = {
        t: why
        or (["named by the first patch"] if any(names(n, t) for n in named) else [])
        for t, why in touches.tests.items()
    }
    return Touches(touches.dirs, tests, [t for t in touches.loaded if not tests[t]])


def cmd_suite(app: App, args: argparse.Namespace) -> int:
    """Run the suite in parallel pytest runs: with the overlay, or the
    selected tests on the base.

    ``--variant overlay``: every test under PATHS, in shards run JOBS at a time, each
    recording which tests read vLLM's installed MoRIIO package; writes
    OUT/outcomes.json, OUT/touches.json and OUT/selection.json (the tests
    that read it, and a small sample of those that do not). ``--variant
    base --selection JSON``: only the selected tests (on the tree as it is:
    unit-base reverts it first).
    """
    root = app.checkout.root
    out: Path = args.out
    # One shard more than the cores: a shard waiting on a child process or a
    # deadline leaves its core to the extra one.
    jobs = args.jobs or (os.cpu_count() or 1) + 1
    only = None
    ids: set[str] | None = None
    if args.variant == "base":
        if args.selection is None:
            raise SuiteError("suite --variant base needs --selection JSON")
        chosen = load_selection(args.selection)
        out.mkdir(parents=True, exist_ok=True)
        only = out / IDS
        only.write_text("".join(f"{t}\n" for t in chosen.ids))
        ids = set(chosen.ids)
        names = sorted({t.split("::", 1)[0] for t in chosen.ids})
        paths = sorted({n.split("/", 1)[0] for n in names})
        files = test_files(root, names)
        app.say(
            f"suite: {count(len(chosen.touched), 'test')} that read vLLM's MoRIIO "
            f"package with the overlay and a sample of {len(chosen.sample)} that "
            f"do not, from {count(len(files), 'file')}, on the tree as installed"
        )
    else:
        paths = args.paths or ["tests"]
        files = test_files(root, paths)
        app.say(f"suite: {count(len(files), 'test file')} with the overlay")
    known: dict[str, float] = {}
    for record in args.times or []:  # later records win, file by file
        known.update(load_file_seconds(record, ids) or {})
    weights = weigh(files, root, known)
    recorded = sum(f.relative_to(root).as_posix() in known for f in files)
    shards = plan(root, files, jobs, weights) if files else []
    expected = sum(weights.values()) / jobs
    app.say(
        f"suite: {count(len(shards), 'shard')}, {jobs} at a time, forked from one "
        f"process that loaded vLLM once; about {expected:.0f} s per core (recorded "
        f"times of {recorded}/{count(len(files), 'file')})"
    )
    outcomes, touches = run_shards(
        root,
        out,
        shards,
        jobs=jobs,
        paths=paths,
        pytest_args=shlex.split(args.pytest_args),
        touch=args.variant == "overlay" and args.evidence,
        only=only,
        progress=app.say,
    )
    _say_slowest(app, out)
    failed = sum(o in ("failed", "error") for o in outcomes.values())
    summary = f"suite ({args.variant}): {count(len(outcomes), 'test')}, {failed} failed"
    result: dict[str, object] = {"outcomes": str(out / "outcomes.json")}
    if touches is not None:
        touches = below_first(touches, app.checkout.series)
        (out / TOUCHES).write_bytes(encode(touches))
        now = load_times(out / TIMES)
        cheap = {
            t
            for t, s in (now.seconds if now else {}).items()
            if s <= SAMPLE_MAX_SECONDS
        }
        pool = {t: w for t, w in touches.tests.items() if w or t in cheap or not now}
        sel = select(
            type(touches)(touches.dirs, pool, touches.loaded),
            SAMPLE,
            app.checkout.series.series_id,
        )
        sel = Selection(sorted(t for t, w in touches.tests.items() if w), sel.sample)
        (out / SELECTION).write_bytes(encode(sel))
        touched = {t: w for t, w in touches.tests.items() if w}
        app.say(
            f"suite: {count(len(touched), 'test')} may read vLLM's MoRIIO package "
            f"({_reasons(touched)}); {len(touches.tests) - len(touched)} cannot "
            f"({len(touches.loaded)} of them had it loaded but neither read nor "
            "ran it)"
        )
        summary += f"; base run: {len(sel.touched)} + a sample of {len(sel.sample)}"
        result["selection"] = str(out / SELECTION)
    app.say(summary)
    app.result(result)
    return 1 if args.check and failed else 0


# The slowest tests a run lists (pytest's --durations=15 --durations-min=2).
SLOWEST = 15
SLOWEST_MIN_SECONDS = 2.0


def _say_slowest(app: App, out: Path) -> None:
    times = load_times(out / TIMES)
    if times is None:
        return
    ranked = sorted(
        ((s, t) for t, s in times.seconds.items() if s >= SLOWEST_MIN_SECONDS),
        reverse=True,
    )[:SLOWEST]
    if ranked:
        app.say(f"suite: the {len(ranked)} slowest tests (setup + call + teardown):")
    for seconds, test in ranked:
        app.say(f"  {seconds:6.1f} s  {test}")


class SuiteError(OverlayError):
    """The suite command was given inconsistent options."""


class LevelsError(OverlayError):
    """A stack level's outcomes are missing."""


def _level_outcomes(
    series: Series, directory: Path
) -> dict[int, dict[str, TestOutcome]]:
    levels = {}
    for k in level_plan(series):
        path = directory / LEVEL_OUTCOMES.format(k=k)
        if not path.is_file():
            raise LevelsError(
                f"{path}: no outcomes for stack level {k}; run `vllm-overlay "
                f"levels --out {directory}` first"
            )
        levels[k] = load_outcomes(path)
    return levels


def cmd_revert_red(app: App, args: argparse.Namespace) -> int:
    """Gate on the unit-base runs: each patch proven on the stack below it.

    Read the outcomes of the suite on the pinned base and with the whole
    series, and (--levels) of each patch's named tests on the stack levels in
    between. Every test in a patch's Tests header must fail on the stack
    below the patch and pass with it; every test in its Guards must pass on
    both. Prints the per-patch table and writes the report export reads.
    """
    checkout = app.checkout
    series = checkout.series
    levels = _level_outcomes(series, args.levels) if args.levels else None
    evidence: list[str] = []
    not_run: frozenset[str] = frozenset()
    if args.touches or args.selection:
        if not (args.touches and args.selection):
            raise LevelsError("revert-red: --touches and --selection go together")
        evidence = evidence_problems(
            load_touches(args.touches),
            load_selection(args.selection),
            base=load_outcomes(args.base_outcomes),
            overlay=load_outcomes(args.overlay_outcomes),
        )
        not_run = frozenset(load_touches(args.touches).tests)
    report = build_report(
        series,
        checkout.pin.vllm.version,
        base=load_outcomes(args.base_outcomes),
        overlay=load_outcomes(args.overlay_outcomes),
        levels=levels,
        not_run=not_run,
    )
    out = args.out or checkout.unit_base_report
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(encode_report(report))
    app.say(format_table(report))
    note = series_level_note(report)
    if note:
        app.say(note)
    problems = [*gate(report, series), *evidence]
    for problem in problems:
        app.say(f"gate: {problem}")
    tests = [r for r in report.stack if r.role == "test"]
    guards = [r for r in report.stack if r.role == "guard"]
    verdict = "FAILED" if problems else "ok"
    app.say(
        f"revert-red: {verdict}; {sum(r.holds for r in tests)}/{len(tests)} named "
        "tests fail on the stack below their patch and pass with it, "
        f"{sum(r.holds for r in guards)}/{len(guards)} guards pass on both; "
        f"{len(report.rows)} tests in all; report {out}"
    )
    app.result({"ok": not problems, "problems": problems, "report": str(out)})
    return 1 if problems else 0


class GateError(OverlayError):
    """The gate cannot start."""


def _say_plan(app: App, dirs: Dirs, todo: list[Step]) -> None:
    root = app.checkout.root
    files = test_files(root, ["tests"])
    app.say(f"gate: would run {count(len(todo), 'step')} in {root}:")
    for step in todo:
        what = f"[{step.phase}] " if step.phase else ""
        after = " (also after a failure)" if step.always else ""
        app.say(f"  {what}{command_line(step)}{after}")
    app.say(f"overlay: {count(len(files), 'test file')} under tests/")
    app.say(
        "base: the tests the overlay run finds reading vLLM's MoRIIO package, "
        f"and a sample of {SAMPLE} of the others (chosen by that run)"
    )
    for k, entries in level_plan(app.checkout.series).items():
        app.say(f"level {k}: {count(len(entries), 'named test')}")
        for entry in entries:
            app.say(f"  {entry}")


def cmd_gate(app: App, args: argparse.Namespace) -> int:
    """Run the unit-base gate: the suite overlaid, the base run, the stack
    levels, revert-red, the export check and a small byte sweep.

    The suite with the series, spread over the cores by recorded seconds
    (ci/suite-times.json, then this machine's last run), recording which
    tests read vLLM's installed MoRIIO package; those tests and a sample of
    the others on the pinned base (the shared environment holds the base
    only while that run lasts); each patch's named tests on the stack levels
    in between; the per-patch revert-red table and its verdict; the whole
    export into a temporary directory; a small byte sweep with the overlay.
    Each step is a `vllm-overlay` process; `--plan` prints them and the
    test selection without running anything. Exit status 1 when a step fails.
    """
    dirs = Dirs(app.checkout.root)
    pytest_args = args.pytest_args
    if args.plan:
        todo = steps(dirs, pytest_args, f"$TMPDIR/{EXPORT_PREFIX}XXXX")
        _say_plan(app, dirs, todo)
        app.say(f"gate --plan: {count(len(todo), 'step')}, nothing run")
        app.result({"steps": [list(s.args) for s in todo]})
        return 0
    env = dict(os.environ)
    for name, value in ((WHEEL_ENV, args.wheel), (OLD_WHEEL_ENV, args.old_wheel)):
        if value is not None:
            env[name] = str(value.resolve())
    if not env.get(WHEEL_ENV):
        raise GateError(
            f"gate: no pinned vLLM wheel: pass --wheel or set ${WHEEL_ENV} "
            "(`nox -s unit-base` does)"
        )
    for line in prepare(dirs):
        app.say(f"gate: {line}")
    run_id = args.run or f"{os.getpid()}@{time.time():.0f}"
    with run_tmpdir(env) as (ram, why):
        if ram is not None:
            env["TMPDIR"] = str(ram)
        app.say(f"gate: temporary files in {env.get('TMPDIR', '/tmp')} ({why})")
        with tempfile.TemporaryDirectory(prefix=EXPORT_PREFIX, dir=ram) as out:
            todo = steps(dirs, pytest_args, out)
            run = run_step(dirs.root)
            done = run_steps(todo, env, run, app.say, dirs.phases, run_id)
    if done.failed is not None:
        app.say(
            f"gate: FAILED at `{command_line(done.failed)}` (exit status "
            f"{done.status}); {done.ran} of {count(len(todo), 'step')} run"
        )
        app.result({"ok": False, "failed": list(done.failed.args)})
        return 1
    app.say(f"gate: ok; {count(done.ran, 'step')} run, phases in {dirs.phases}")
    app.result({"ok": True})
    return 0


def cmd_removable(app: App, args: argparse.Namespace) -> int:
    """Prove each connector workaround removable with its core patch.

    For each core patch (patches/core/): its named tests on the whole
    connector series without it and with it (fail, then pass). For each
    connector patch whose Remove-When names "core patch cNNN": the whole
    series with the patch's hunks reverse-applied, its named tests without
    the core patch (they must fail: the proof can fail) and with it (they
    must pass). One verdict line per workaround, "NNNN removable with core
    patch cNNN: yes" or "no (why)"; exit status 1 unless every verdict is
    yes and every core patch's tests fail without it and pass with it. The
    report goes to --out (`vllm-overlay export` reads it for core bundles).
    """
    checkout = app.checkout
    series = checkout.series
    core = load_core_series(checkout.root)
    source = base_source(args)
    bases = source.load(checkout.pin, series)
    known = workarounds(series, core)
    for wanted in args.patch or ():
        if not any(wanted in (w.name, w.slug, w.name[:4]) for w, _ in known):
            those = ", ".join(w.name[:4] for w, _ in known) or "none"
            raise OverlayError(
                f"--patch {wanted}: not a patch whose Remove-When names a core "
                f"patch (those are: {those})"
            )
    inputs = Inputs(series, core, bases.texts, source.load_core(checkout.pin))
    app.say(
        f"removable: series {series.series_id}, "
        f"{count(len(core.patches), 'core patch', 'core patches')}, base files "
        f"from {bases.source}"
    )
    # One server loads the proofs' third-party modules once (each proof
    # loads vLLM from its own tree): the runs start in a second, not ten.
    entries = named_entries(inputs)
    names = preload_names(checkout.root, {**bases.texts, **inputs.core_bases}, entries)
    with PytestPool(checkout.root, names) as pool:
        run = pytest_runner(
            checkout.root, checkout.pin, pool, shlex.split(args.pytest_args)
        )
        report = prove_all(
            inputs,
            run,
            checkout.pin.vllm.version,
            progress=app.say,
            only=args.patch or (),
            jobs=args.jobs,
        )
    if pool.ready is not None:
        app.say(
            f"removable: {count(pool.next_id, 'pytest run')} forked from one "
            f"process that loaded {pool.ready.modules} modules once "
            f"({pool.ready.seconds:.0f} s)"
        )
    out = args.out or checkout.root / ".nox-reports" / REMOVABLE_REPORT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(encode_removable(report))
    broken = [r for r in report.core_rows if not r.holds]
    for r in broken:
        app.say(
            f"error: core patch {r.core}: {r.test_id} is {r.without} without it "
            f"and {r.with_} with it (it must fail, then pass)"
        )
    for v in report.verdicts:
        app.say(v.line + (f"; {v.why}" if v.removable else ""))
    yes = sum(v.removable for v in report.verdicts)
    ok = not broken and yes == len(report.verdicts) and bool(report.core_rows)
    app.say(
        f"removable: {'ok' if ok else 'FAILED'}, {yes} of "
        f"{count(len(report.verdicts), 'workaround')} removable with its core "
        f"patch, {len(report.core_rows) - len(broken)} of "
        f"{count(len(report.core_rows), 'core test')} red without and green "
        f"with its core patch; report {out}"
    )
    app.result({"ok": ok, "report": str(out)})
    return 0 if ok else 1


def jobs_count(text: str) -> int:
    """``--jobs``: how many at a time, 0 for one per core."""
    try:
        jobs = int(text)
    except ValueError:
        jobs = -1
    if jobs < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: how many at a time, 1 or more (0: one per core)"
        )
    return jobs


def register(sub: Subparsers) -> None:
    ga = add_command(sub, "gate", cmd_gate)
    ga.add_argument("--plan", action="store_true", help="print the steps; run nothing")
    ga.add_argument(
        "--pytest-args",
        default="",
        metavar="ARGS",
        help="more pytest arguments for the overlay and base runs",
    )
    ga.add_argument(
        "--wheel",
        type=Path,
        metavar="WHEEL",
        help=f"the pinned vLLM wheel (default: ${WHEEL_ENV})",
    )
    ga.add_argument(
        "--old-wheel",
        type=Path,
        metavar="WHEEL",
        help=f"the older vLLM of the rebase tests (default: ${OLD_WHEEL_ENV})",
    )
    ga.add_argument(
        "--run",
        default="",
        metavar="ID",
        help="the run the phases' seconds belong to (`nox` passes its own, "
        "so lint's phase joins them)",
    )
    su = add_command(sub, "suite", cmd_suite)
    su.add_argument("--out", type=Path, required=True, metavar="DIR")
    su.add_argument("--variant", choices=("overlay", "base"), default="overlay")
    su.add_argument("--selection", type=Path, metavar="JSON", help="base: the tests")
    su.add_argument(
        "--jobs", type=jobs_count, default=0, help="shards at a time (cores + 1)"
    )
    su.add_argument(
        "--times",
        type=Path,
        action="append",
        metavar="JSON",
        help="recorded seconds (a run's times.json or file-times.json, "
        "ci/suite-times.json) that spread the files; repeatable, later ones win",
    )
    su.add_argument("--pytest-args", default="", metavar="ARGS")
    su.add_argument(
        "--no-evidence",
        dest="evidence",
        action="store_false",
        help="overlay: record no evidence for a base run (`nox -s unit`)",
    )
    su.add_argument(
        "--check", action="store_true", help="exit status 1 when a test fails"
    )
    su.add_argument("paths", nargs="*", metavar="PATH", help="default: tests")
    lv = add_command(sub, "levels", cmd_levels)
    lv.add_argument("--out", type=Path, required=True, metavar="DIR", help="outcomes")
    lv.add_argument(
        "--pytest-args",
        default="",
        metavar="ARGS",
        help="more pytest arguments for every level",
    )
    lv.add_argument(
        "--jobs", type=jobs_count, default=0, help="levels at a time (cores)"
    )
    add_base_options(lv, "the pinned base files")
    rm = add_command(sub, "removable", cmd_removable)
    rm.add_argument(
        "--patch",
        action="append",
        metavar="NNNN",
        help="only this workaround (its number or name) and its core patch; repeatable",
    )
    rm.add_argument(
        "--out",
        type=Path,
        metavar="JSON",
        help="the report (default: .nox-reports/removable.json in the checkout)",
    )
    rm.add_argument(
        "--pytest-args", default="", metavar="ARGS", help="more pytest arguments"
    )
    rm.add_argument(
        "--jobs", type=jobs_count, default=0, help="proofs at a time (cores)"
    )
    add_base_options(rm, "the pinned base files")
    rr = add_command(sub, "revert-red", cmd_revert_red)
    rr.add_argument("--base-outcomes", type=Path, required=True, metavar="JSON")
    rr.add_argument("--overlay-outcomes", type=Path, required=True, metavar="JSON")
    rr.add_argument(
        "--levels",
        type=Path,
        metavar="DIR",
        help="outcomes of the stack levels in between (`vllm-overlay levels`)",
    )
    rr.add_argument(
        "--touches",
        type=Path,
        metavar="JSON",
        help="which tests read vLLM's MoRIIO package (`vllm-overlay suite`)",
    )
    rr.add_argument(
        "--selection",
        type=Path,
        metavar="JSON",
        help="the tests the base run was given (`vllm-overlay suite`)",
    )
    rr.add_argument(
        "--out",
        type=Path,
        metavar="JSON",
        help="the report (default: .nox-reports/unit-base.json in the checkout)",
    )
