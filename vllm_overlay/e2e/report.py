"""The run report: JSON and Markdown under the run directory."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from vllm_overlay.e2e.checks import Section
from vllm_overlay.e2e.load import LoadResult
from vllm_overlay.e2e.secret import scrub

MAX_ROWS = 400


class Report(msgspec.Struct, forbid_unknown_fields=True):
    image: str
    series_id: str
    config: dict[str, Any]
    sections: list[Section]
    error: str = ""  # the run stopped early (launch failure, interruption)
    launcher: str = "ssh"
    front_end: str = ""
    # What the rules (expect.py) predict for the image that ran.
    notes: list[str] = msgspec.field(default_factory=list)
    # How the CLI's preflight ended ("" when run() was called directly).
    preflight: str = ""
    # The load phase (`vllm bench serve`): TTFT/TPOT/ITL per cell.
    load: list[LoadResult] = msgspec.field(default_factory=list)
    # Where the per-request NIC bytes come from, or why they are missing.
    nic: str = ""
    # The report of a fake engine (the docs' example), said at its top.
    fake_engine: bool = False

    @property
    def ok(self) -> bool:
        return not self.error and all(s.status != "fail" for s in self.sections)


def markdown(report: Report) -> str:
    verdict = "PASS" if report.ok else "FAIL"
    lines = [
        f"# MoRIIO E2E: {verdict}",
        "",
        *(
            ["> From the fake engine (tests/e2e stand-ins), not hardware.", ""]
            if report.fake_engine
            else []
        ),
        f"- image: `{report.image}`",
        f"- series: `{report.series_id or 'unknown'}`",
        f"- run: `{report.config.get('name', '')}`, launcher {report.launcher}, "
        f"front end {report.front_end or 'unknown'}",
    ]
    if report.preflight:
        lines.append(f"- preflight: {report.preflight}")
    if report.nic:
        lines.append(f"- NIC bytes: {report.nic}")
    if report.error:
        lines.append(f"- stopped early: {report.error}")
    lines += [f"- {note}" for note in report.notes]
    lines += ["", "## Sections", "", "| section | status | summary |", "|---|---|---|"]
    for s in report.sections:
        summary = ", ".join(f"{k}={v}" for k, v in s.summary.items() if v != "")
        lines.append(f"| {s.name} | {s.status} | {summary} |")
    if report.load:
        lines += load_table(report.load)
    for s in report.sections:
        lines += ["", f"## {s.name}: {s.status}", ""]
        lines += ["| case | length | status | detail |", "|---|---|---|---|"]
        rows = sorted(s.cases, key=lambda c: c.status != "fail")[:MAX_ROWS]
        for c in rows:
            detail = c.detail.replace("|", "\\|").replace("\n", "<br>")
            if c.first_mismatch >= 0:
                detail = f"first mismatch at output token {c.first_mismatch}: {detail}"
            if c.expected:
                detail = f"{detail} ({c.expected})" if detail else c.expected
            lines.append(f"| {c.id} | {c.length or ''} | {c.status} | {detail} |")
        if len(s.cases) > MAX_ROWS:
            lines.append(f"| ... | | | {len(s.cases) - MAX_ROWS} more in report.json |")
    lines += ["", "## Config", "", "```json"]
    lines.append(msgspec.json.format(msgspec.json.encode(report.config)).decode())
    lines += ["```", ""]
    return "\n".join(lines)


def load_table(results: list[LoadResult]) -> list[str]:
    """The serving figures: one row per ISL/OSL/concurrency cell."""
    lines = [
        "",
        "## Serving figures (`vllm bench serve` against the front end)",
        "",
        "| ISL/OSL | concurrency | completed | req/s | out tok/s | TTFT p50/p90/p99 ms "
        "| TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in results:
        r = c.result
        if r is None:
            lines.append(
                f"| {c.input_len}/{c.output_len} | {c.concurrency} | {c.error} "
                "| | | | | |"
            )
            continue
        lines.append(
            f"| {c.input_len}/{c.output_len} | {c.concurrency} | "
            f"{r.completed}/{c.prompts} | {r.request_throughput:.2f} | "
            f"{r.output_throughput:.0f} | {r.p50_ttft_ms:.1f}/{r.p90_ttft_ms:.1f}/"
            f"{r.p99_ttft_ms:.1f} | {r.p50_tpot_ms:.2f}/{r.p90_tpot_ms:.2f}/"
            f"{r.p99_tpot_ms:.2f} | {r.p50_itl_ms:.2f}/{r.p90_itl_ms:.2f}/"
            f"{r.p99_itl_ms:.2f} |"
        )
    return lines


def write_report(
    report: Report, run_dir: Path, secrets: Iterable[str] = ()
) -> tuple[Path, Path]:
    """report.json and report.md; any of ``secrets`` in them (a server's
    log line, an error) is shown as ``***``. The config in ``report`` is
    already masked (`encode_config`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    hidden = set(secrets)
    js, md = run_dir / "report.json", run_dir / "report.md"
    data = msgspec.json.format(msgspec.json.encode(report), indent=2).decode()
    js.write_text(scrub(data, hidden) + "\n")
    md.write_text(scrub(markdown(report), hidden))
    return js, md


def read_report(path: Path) -> Report:
    return msgspec.json.decode(path.read_bytes(), type=Report)
