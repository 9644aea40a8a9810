"""`vllm-overlay export | rebase`: the series toward and from upstream vLLM."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from vllm_overlay.checkout import Checkout
from vllm_overlay.command import App, Subparsers, add_command
from vllm_overlay.series.pin import Pin
from vllm_overlay.text import count
from vllm_overlay.tree.baseopts import add_base_options, base_source
from vllm_overlay.tree.materialize import BaseSource
from vllm_overlay.upstream.export import (
    DEFAULT_OUT,
    RUFF_VERSION,
    ExportError,
    export,
    load_context,
)
from vllm_overlay.upstream.gitmail import Identity, user_identity
from vllm_overlay.upstream.rebase import seriesref
from vllm_overlay.upstream.rebase.newbase import (
    DEFAULT_CACHE,
    fetch_version,
    is_downgrade,
    resolve_new_base,
)
from vllm_overlay.upstream.rebase.plan import (
    DEFAULT_WORKDIR,
    applied_version,
    carries_series,
    rebase_plan,
    write_plan,
)
from vllm_overlay.upstream.rebase.refreshed import load_refreshed
from vllm_overlay.upstream.rebase.report import (
    RebaseError,
    RebaseReport,
    encode_report,
    format_table,
    result_counts,
)


def cmd_export(app: App, args: argparse.Namespace) -> int:
    """Upstream-ready patch mails and PR bodies under dist/upstream.

    Write each patch as a `git format-patch` mail with its tests ported to
    vLLM's layout, and its pull-request body, after checking it applies, is
    proven by the unit-base report and passes vLLM's ruff.
    """
    ctx = load_context(
        app.checkout,
        base_source(args),
        ruff=args.ruff,
        run_tests=args.run_tests,
        signoff=_signoff(app, args),
    )
    out = app.checkout.path(args.out)
    written = export(ctx, args.patch or [], out)
    for path in written:
        if path.name == "checks.log":
            app.say(path.read_text().rstrip("\n"))
        app.say(f"  wrote {path}")
    app.say(f"export: {count(len(written) // 3, 'bundle')} in {out}")
    app.result({"out": str(out), "files": [str(p) for p in written]})
    return 0


def _signoff(app: App, args: argparse.Namespace) -> Identity | None:
    """--signoff, else the exporter's git identity; None with --no-signoff."""
    if args.no_signoff:
        return None
    if args.signoff:
        return Identity.parse(args.signoff)
    who = user_identity(app.checkout.root)
    if who is None:
        raise ExportError(
            "no identity to sign the mails off with (vLLM's DCO check needs a "
            "Signed-off-by): set git config user.name and user.email, or pass "
            "--signoff 'Name <email>' (--no-signoff: mails without one)"
        )
    return who


def cmd_rebase(app: App, args: argparse.Namespace) -> int:
    """Classify and move the series onto a newer vLLM base.

    Classify every patch against a newer vLLM (clean, offset, upstream,
    partly upstream, conflict, blocked); with --write and no conflict, write
    the new pin, the refreshed patches and the records of dropped ones. A
    patch that landed upstream in another form is set aside (the patches
    above are assessed without it) until its hand-refreshed remainder is
    given with --refreshed. --series-ref reads the series from a git ref
    (the 0.33.0 series: series-0.33.0).
    """
    if not args.series_ref:
        return _rebase(app, args, app.checkout, "")
    if args.write:
        raise RebaseError(
            f"--series-ref {args.series_ref} with --write: the series of a ref is "
            "only assessed here; check that ref out to rebase it"
        )
    root = app.checkout.root
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-series-") as tmp:
        commit = seriesref.export_series(root, args.series_ref, Path(tmp))
        ref = f"{args.series_ref} ({commit[:9]})"
        return _rebase(app, args, Checkout(Path(tmp)), ref)


def _old_base(args: argparse.Namespace, pin: Pin, from_ref: bool) -> BaseSource:
    """--wheel / --from; for a series read from a ref without them, its
    pinned wheel from --cache (fetched with pip when missing)."""
    source = base_source(args)
    if not from_ref or source.wheel is not None or source.tree is not None:
        return source
    cached = args.cache / pin.vllm.wheel
    wheel = cached if cached.is_file() else fetch_version(pin.vllm.version, args.cache)
    return BaseSource(wheel=wheel)


def _rebase(
    app: App, args: argparse.Namespace, checkout: Checkout, series_ref: str
) -> int:
    pin, series = checkout.pin, checkout.series
    old_bases = _old_base(args, pin, bool(series_ref)).load(pin, series).texts
    new = resolve_new_base(
        args.to, pin.module, args.cache, pin.vllm.version, pin.core_files
    )
    given = load_refreshed(args.refreshed, series, applied_version(new))
    workdir = app.checkout.path(args.workdir) / new.version
    report_path = args.report or workdir / "rebase.json"
    if carries_series(old_bases, series, new):
        report = RebaseReport(
            from_version=pin.vllm.version,
            to_version=new.version,
            to_source=new.source,
            series_id=series.series_id,
            workdir=str(workdir),
            rows=[],
            carries_series=True,
            series_ref=series_ref,
        )
        _write_report(report_path, report)
        app.result(report)
        app.say(
            f"rebase: {new.source} already carries this series (vLLM "
            f"{pin.vllm.version} + {len(series.patches)} patches, series "
            f"{series.series_id}): nothing to do"
        )
        return 0
    if new.overlay:
        raise RebaseError(
            f"{new.source} carries {new.overlay}, not this series "
            f"({series.series_id}): rebase onto a vLLM without an overlay (its "
            "wheel, or the tree after `vllm-overlay apply --revert`)"
        )
    report, plan = rebase_plan(
        pin, series, old_bases, new, workdir, git_commit=args.git_commit, given=given
    )
    report.downgrade = is_downgrade(pin.vllm.version, new.version)
    report.series_ref = series_ref
    if plan is not None and args.write:
        for path in write_plan(checkout.root, plan):
            app.say(f"  wrote {path}" if path.exists() else f"  removed {path}")
        report.written = True
    app.say(format_table(report))
    _write_report(report_path, report)
    app.say(f"rebase: report written to {report_path}")
    app.result(report)
    counts = result_counts(report)
    if plan is None:
        app.say(
            f"rebase: {counts}: {_why_not(report)}; nothing in the repository changed"
        )
        return 1
    if args.write:
        app.say(f"rebase: {counts}: the series is on vLLM {new.version}")
    else:
        app.say(
            f"rebase: {counts}: every patch applies or is upstream; --write "
            "updates the pin"
        )
    return 0


def _why_not(report: RebaseReport) -> str:
    """Why the series cannot move: what conflicts, what needs a hand."""
    why = []
    if any(r.result in ("conflict", "blocked") for r in report.rows):
        why.append("not every patch applies")
    hand = [r.patch.split("-", 1)[0] for r in report.by_hand]
    if hand:
        said = ", ".join(hand)
        verb = "needs" if len(hand) == 1 else "need"
        why.append(
            f"{said} landed upstream in another form and {verb} a hand-refreshed "
            "remainder (--refreshed)"
        )
    return "; ".join(why)


def _write_report(path: Path, report: RebaseReport) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_report(report))


def register(sub: Subparsers) -> None:
    p = add_command(sub, "export", cmd_export)
    patches = "a patch name, slug or number (0009) (repeat; default: every patch)"
    p.add_argument("--patch", action="append", metavar="NAME", help=patches)
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help="where the bundles go (default: %(default)s in the checkout)",
    )
    add_base_options(p, "the pinned base")
    p.add_argument("--ruff", metavar="PATH", help=f"the ruff {RUFF_VERSION} executable")
    p.add_argument(
        "--run-tests",
        action="store_true",
        help="also run each ported test file alone (this Python's vLLM overlaid)",
    )
    sign = p.add_mutually_exclusive_group()
    sign.add_argument(
        "--signoff",
        metavar="'NAME <EMAIL>'",
        help="who signs the mails off (default: git config user.name/user.email); "
        "this project's own patches are also authored by them",
    )
    sign.add_argument(
        "--no-signoff",
        action="store_true",
        help="no Signed-off-by (vLLM's DCO check then fails)",
    )

    p = add_command(sub, "rebase", cmd_rebase)
    p.add_argument(
        "--to",
        required=True,
        metavar="VERSION|WHEEL|DIR",
        help="the new base: a vLLM version (fetched with pip), a wheel, a source tree",
    )
    add_base_options(p, "the pinned (old) base")
    p.add_argument(
        "--workdir",
        type=Path,
        default=DEFAULT_WORKDIR,
        metavar="DIR",
        help="conflicts and the report go here (default: %(default)s)",
    )
    p.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help="the report file (default: WORKDIR/VERSION/rebase.json)",
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=DEFAULT_CACHE,
        metavar="DIR",
        help="where fetched wheels are kept (default: %(default)s)",
    )
    p.add_argument(
        "--git-commit",
        default="",
        metavar="SHA",
        help="the new base's vLLM commit, if not recorded",
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="write the new pin and refreshed patches (only if all apply)",
    )
    p.add_argument(
        "--refreshed",
        nargs="+",
        default=[],
        type=Path,
        metavar="PATCH",
        help="a hand-refreshed remainder of a patch that landed upstream in "
        "another form, named as that patch, its Applied-Upstream '<version> "
        "(in part)': used in its place on the new base",
    )
    p.add_argument(
        "--series-ref",
        default="",
        metavar="REF",
        help="read pin.toml and patches/ from this git ref of the checkout "
        "(series-0.33.0, origin/release/0.33); its pinned wheel comes from "
        "--cache unless --wheel/--from; no --write",
    )
