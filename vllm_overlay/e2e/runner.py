"""One E2E run: launch the pair, send every check's prompts, judge, report."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vllm_overlay.e2e.checks import (
    Exchange,
    Section,
    Transfer,
    needle_section,
    overlay_section,
    repeat_section,
    sweep_section,
    transfer_section,
)
from vllm_overlay.e2e.client import (
    EXTERNAL_HITS,
    LOCAL_HITS,
    Completion,
    complete,
    scrape,
)
from vllm_overlay.e2e.config import PairConfig, encode_config
from vllm_overlay.e2e.launch import Launcher, LaunchError, Terminated, sigterm_raises
from vllm_overlay.e2e.plan import Plan, build_plan
from vllm_overlay.e2e.prompts import (
    Prompt,
    kv_prompt,
    load_tokenizer,
    needle_prompt,
    sweep_lengths,
    sweep_prompts,
)
from vllm_overlay.e2e.report import Report, write_report

# The full-local-hit repeat uses a prompt of its own, not sent before.
REPEAT_LENGTH = 2000
NOT_SENT = Completion([], "", 0, error="not sent")


def layout_block_sizes(config: PairConfig) -> list[int]:
    """Position-table block sizes: each page size times the DCP size."""
    sizes = [config.model.block_size, *config.model.extra_block_sizes]
    return sorted({b * config.prefill.dcp for b in sizes})


def planned_lengths(config: PairConfig) -> list[int]:
    c = config.checks
    return sweep_lengths(
        layout_block_sizes(config),
        c.sweep_max_len,
        c.boundary_offsets,
        c.sweep_min_count,
    )


class Endpoints:
    def __init__(self, config: PairConfig) -> None:
        self.pd = f"http://{config.router.address}:{config.router.port}"
        self.direct = f"http://{config.prefill.address}:{config.prefill.http_port}"
        self.decode = f"http://{config.decode.address}:{config.decode.http_port}"


def exchange(config: PairConfig, ends: Endpoints, prompt: Prompt) -> Exchange:
    """Send ``prompt`` through P/D and directly to the prefill server,
    measuring the decoder's counters around the P/D request."""
    c, t = config.checks, config.timeouts
    ex = Exchange(
        prompt.id, prompt.kind, prompt.length, prompt.expected,
        pd=NOT_SENT, direct=NOT_SENT,
    )  # fmt: skip
    if prompt.length + c.max_tokens > config.model.max_model_len:
        ex.skipped = f"{prompt.length} tokens + answer exceed max_model_len"
        return ex
    name = config.model.served_name
    before = scrape(ends.decode, t.request_s)
    ex.pd = complete(ends.pd, name, prompt.token_ids, c.max_tokens, t.request_s)
    after = scrape(ends.decode, t.request_s)
    ex.direct = complete(ends.direct, name, prompt.token_ids, c.max_tokens, t.request_s)
    if before is not None and after is not None:
        loaded = after[EXTERNAL_HITS] - before[EXTERNAL_HITS]
        ex.transfer = Transfer(
            loaded,
            after[LOCAL_HITS] - before[LOCAL_HITS],
            int(loaded * config.model.kv_bytes_per_token),
        )
    return ex


def read_logs(log_dir: Path) -> dict[str, str]:
    return {
        role: (log_dir / f"{role}.log").read_text(errors="replace")
        for role in ("prefill", "decode")
        if (log_dir / f"{role}.log").is_file()
    }


def run(
    config: PairConfig,
    run_dir: Path,
    expected_series: str = "",
    say: Callable[[str], None] = print,
    plan: Plan | None = None,
) -> Report:
    """Run every check; ``plan`` defaults to the config's full plan."""
    tok = load_tokenizer(config.model.tokenizer)
    seed = config.checks.seed
    sweep = sweep_prompts(tok, planned_lengths(config), seed)
    needles = [needle_prompt(tok, w, seed) for w in config.checks.needle_words]
    repeat = kv_prompt(tok, REPEAT_LENGTH, seed + 1)
    say(f"e2e: {len(sweep)} sweep prompts, {len(needles)} needles, 1 repeat")

    ends = Endpoints(config)
    log_dir = run_dir / "logs"
    sweep_ex: list[Exchange] = []
    needle_ex: list[Exchange] = []
    repeat_ex: list[Exchange] = []
    error = ""
    plan = plan if plan is not None else build_plan(config)
    launcher = Launcher(plan, log_dir, config.timeouts.poll_s, say)
    try:
        with sigterm_raises(), launcher:
            launcher.setup()
            for group, prompts in ((sweep_ex, sweep), (needle_ex, needles)):
                for prompt in prompts:
                    group.append(exchange(config, ends, prompt))
            repeat_ex = [exchange(config, ends, repeat) for _ in range(2)]
    except (LaunchError, Terminated, KeyboardInterrupt) as e:
        error = f"{type(e).__name__}: {e}"

    sections: list[Section] = [overlay_section(read_logs(log_dir), expected_series)]
    if not error:
        sections += [
            sweep_section(sweep_ex),
            needle_section(needle_ex),
            repeat_section(*repeat_ex),
            transfer_section([*sweep_ex, *needle_ex, *repeat_ex]),
        ]
    series = str(sections[0].summary.get("series", "")) or expected_series
    report = Report(
        config.container.image, series, encode_config(config), sections, error
    )
    js, md = write_report(report, run_dir)
    say(f"e2e: {'PASS' if report.ok else 'FAIL'}; report {md} and {js}")
    return report
