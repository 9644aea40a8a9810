"""`vllm-overlay series ...`: the patch series itself."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_overlay.command import App, Subparsers, add_command, add_subcommands
from vllm_overlay.series.core_series import (
    check_core_series,
    core_fix,
    load_core_series,
)
from vllm_overlay.series.patch_series import SeriesError, check_series, load_series
from vllm_overlay.text import count


def cmd_series_check(app: App, args: argparse.Namespace) -> int:
    """Check the series file, the patch headers and the diffs.

    Check patches/series (each entry once, every patch listed), every DEP-3
    header (Forwarded no, not-needed or a URL; an upstream Origin with its
    URL; every required field; no undeclared field), Builds-On, the tests
    each header names, and that every diff touches only pinned files. A
    series listing no patch is refused unless --allow-empty. The core series
    (patches/core/: upstream-only fixes to vLLM core files, pinned in
    pin.toml's core_files) is checked the same way, and a Remove-When naming
    a core patch must name one it lists, with its bundle. Each problem is
    one line; exit status 2.
    """
    checkout = app.checkout
    problems = check_series(checkout.root, checkout.pin, allow_empty=args.allow_empty)
    try:
        connector = load_series(checkout.root)
    except SeriesError:
        connector = None  # check_series said why
    problems += check_core_series(checkout.root, checkout.pin, connector)
    for problem in problems:
        app.say(f"error: {problem}")
    if problems:
        app.say(f"series check: {count(len(problems), 'problem')}")
        app.result({"ok": False, "problems": problems})
        return 2
    series = checkout.series
    for p in series.patches:
        h = p.header
        files = ", ".join(Path(f.path).name for f in p.files)
        where = h.upstream_url or f"Forwarded: {h.forwarded}"
        app.say(
            f"  {p.index:>2}  {p.name}  ({files}; {count(len(h.tests), 'test')}, "
            f"{count(len(h.guards), 'guard')}; {h.author}; {where})"
        )
    core = load_core_series(checkout.root)
    for p in core.patches:
        h = p.header
        files = ", ".join(Path(f.path).name for f in p.files)
        fixes = [w.name for w in series.patches if core_fix(w.header) == p.name[:4]]
        app.say(
            f"  core {p.name}  ({files}; {count(len(h.tests), 'test')}; "
            f"upstream-only; replaces {', '.join(fixes) or 'no workaround'})"
        )
    app.say(
        f"series check: ok, {count(len(series.patches), 'patch', 'patches')}, "
        f"series {series.series_id}, "
        f"{count(len(core.patches), 'core patch', 'core patches')}"
    )
    result = {
        "series_id": series.series_id,
        "patches": series.names,
        "core_patches": core.names,
    }
    # The vLLM files the series changes: `nox -s lint` checks them.
    app.result({"ok": True, **result, "files": series.touched_paths()})
    return 0


def register(sub: Subparsers) -> None:
    series = add_command(
        sub,
        "series",
        None,
        doc="The patch series: patches/series and the patches it lists.",
    )
    series_sub = add_subcommands(series, "series_command")
    check = add_command(series_sub, "check", cmd_series_check)
    check.add_argument(
        "--allow-empty",
        action="store_true",
        help="accept a series that lists no patch (applying it is the pinned base)",
    )
