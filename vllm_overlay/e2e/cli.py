"""`vllm-overlay e2e --config F [--dry-run] [--run-dir D]`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vllm_overlay.command import App, Subparsers, add_command
from vllm_overlay.e2e.config import load_config
from vllm_overlay.e2e.plan import build_plan, format_plan
from vllm_overlay.errors import OverlayError


def dry_run_text(config_path: Path) -> str:
    from vllm_overlay.e2e.runner import layout_block_sizes, planned_lengths

    config = load_config(config_path)
    lengths = planned_lengths(config)
    c = config.checks
    pd = f"http://{config.router.address}:{config.router.port}"
    direct = f"http://{config.prefill.address}:{config.prefill.http_port}"
    decode = f"http://{config.decode.address}:{config.decode.http_port}"
    checks = [
        f"[harness] every prompt: POST {pd}/v1/completions (P/D) and "
        f"{direct}/v1/completions (direct prefill), greedy, {c.max_tokens} tokens, "
        f"prompt as token ids from {config.model.tokenizer}",
        f"[harness] around every P/D request: GET {decode}/metrics",
        f"prompt-length sweep: {len(lengths)} key-value prompts, block sizes "
        f"{layout_block_sizes(config)}, offsets {c.boundary_offsets}: "
        + " ".join(map(str, lengths)),
        f"needle in a haystack: {', '.join(map(str, c.needle_words))} words",
        "full-local-hit repeat: one prompt twice through P/D",
    ]
    return format_plan(build_plan(config), checks)


def expected_series(app: App) -> str:
    """The series id of the overlay checkout this runs from, if any."""
    try:
        return app.checkout.series.series_id
    except OverlayError:
        return ""


def cmd_e2e(app: App, args: argparse.Namespace) -> int:
    """1P/1D MoRIIO READ run on two nodes: P/D vs direct prefill.

    Launch one prefill and one decode vLLM server with the MoRIIO connector
    in READ mode and a router, send the checks' prompts through P/D and to
    the prefill alone, and compare.
    """
    if args.dry_run:
        app.say(dry_run_text(args.config).rstrip("\n"))
        return 0
    from vllm_overlay.e2e.runner import run

    config = load_config(args.config)
    run_dir = (
        args.run_dir or Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    report = run(config, run_dir, expected_series(app))
    app.result(report)
    return 0 if report.ok else 1


def register(sub: Subparsers) -> None:
    p = add_command(sub, "e2e", cmd_e2e)
    p.add_argument(
        "--config", type=Path, required=True, metavar="TOML", help="the pair config"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print every command, launch nothing"
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="report directory (default: runs/NAME-TIME)",
    )
