"""`e2e --ab`: the base image (`image build --series none`) and the overlay
image, one after the other on the same nodes, with the same checks; a side
by side report of the lengths each gets wrong and the bytes each moves.

On the base, the failures the rules predict (expect.py) are expected: the
A/B verdict fails only on an unexpected failure of either image, or a run
that stopped early."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

from vllm_overlay.e2e.checks import NO_SERIES
from vllm_overlay.e2e.config import ConfigError, RunConfig
from vllm_overlay.e2e.load import LoadResult
from vllm_overlay.e2e.report import Report
from vllm_overlay.e2e.runid import new_run_id
from vllm_overlay.e2e.runner import run
from vllm_overlay.safefile import replace_file

LauncherKind = Literal["ssh", "slurm", "attach"]
SIDES = ("base", "overlay")
# The tag `image build --series none` gives the base: v<vLLM>-base.
BASE_SUFFIX = "base"
_TAG = re.compile(r"^(?P<repo>.+:v[^:/@]+?)-(?P<suffix>[A-Za-z0-9_.]+)$")


def base_image(config: RunConfig) -> str:
    """The A/B base image: ``container.base_image``, else the overlay
    image's tag with its last ``-SUFFIX`` replaced by ``-base`` (the tag
    `image build --series none --tag REPO` gives)."""
    c = config.container
    if c.base_image:
        return c.base_image
    m = _TAG.match(c.image)
    if m is None or m.group("suffix") == BASE_SUFFIX:
        raise ConfigError(
            f"{config.name}: --ab: no base image for {c.image} (a tag "
            "REPO:v<vLLM>-<suffix> names its base REPO:v<vLLM>-base); set "
            "container.base_image"
        )
    return f"{m.group('repo')}-{BASE_SUFFIX}"


def side_configs(config: RunConfig, run_id: str = "") -> dict[str, RunConfig]:
    """The base's and the overlay's configs: the same nodes and checks, the
    image and the run id (``RUNID`` + b / o) differ."""
    rid = (run_id or config.container.run_id or new_run_id())[:15]
    out: dict[str, RunConfig] = {}
    for side, image in (
        ("base", base_image(config)),
        ("overlay", config.container.image),
    ):
        container = msgspec.structs.replace(
            config.container, image=image, run_id=rid + side[0]
        )
        out[side] = msgspec.structs.replace(config, container=container)
    return out


def expected_series(side: str, overlay_series: str) -> str:
    return NO_SERIES if side == "base" else overlay_series


class AbSide(msgspec.Struct, forbid_unknown_fields=True):
    """What one image did, from its report."""

    side: str  # "base" or "overlay"
    image: str
    series_id: str
    report: str  # its report.md
    error: str
    prompts: int
    wrong: list[int]  # sweep lengths whose P/D answer differed
    predicted: list[int]  # of those, the ones the rules predict
    unexpected: list[int]
    predicted_but_passed: list[int]
    kv_tokens: float  # tokens the decoders loaded (counters), all requests
    kv_bytes: int  # kv_tokens x kv_bytes_per_token (0: unknown)
    nic_bytes: int = -1  # bytes the decode nodes' NICs received; -1: not read
    load: list[LoadResult] = msgspec.field(default_factory=list)
    # Every server logged the banner this image must show (the base line
    # for the base, the checkout's series for the overlay).
    banner_ok: bool = True

    @property
    def ok(self) -> bool:
        return not self.error and not self.unexpected and self.banner_ok


class AbReport(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    launcher: str
    sides: list[AbSide]

    @property
    def ok(self) -> bool:
        return len(self.sides) == len(SIDES) and all(s.ok for s in self.sides)


def lengths(text: object) -> list[int]:
    return [int(x) for x in str(text).replace(",", " ").split()]


def side_of(side: str, report: Report, report_path: Path) -> AbSide:
    sweep = next((s for s in report.sections if s.name == "prompt-length sweep"), None)
    wrong = [c.length for c in sweep.cases if c.status == "fail"] if sweep else []
    predicted = (
        [c.length for c in sweep.cases if c.status == "fail" and c.expected]
        if sweep
        else []
    )
    missed = lengths(sweep.summary.get("predicted_but_passed", "")) if sweep else []
    moved = next((s for s in report.sections if s.name == "transfer per request"), None)
    summary = moved.summary if moved else {}
    nic_bytes = int(summary.get("nic_bytes_total", -1))
    banner = next((s for s in report.sections if s.name == "overlay"), None)
    banner_ok = banner is not None and banner.status == "pass"
    return AbSide(
        side, report.image, report.series_id, str(report_path), report.error,
        len(sweep.cases) if sweep else 0, wrong, predicted,
        [n for n in wrong if n not in predicted], missed,
        float(summary.get("tokens_total", 0)), int(summary.get("bytes_total", 0)),
        nic_bytes, report.load, banner_ok,
    )  # fmt: skip


def _few(values: list[int], limit: int = 12) -> str:
    if not values:
        return "none"
    text = " ".join(map(str, values[:limit]))
    return f"{len(values)}: {text}{' ...' if len(values) > limit else ''}"


def markdown(report: AbReport) -> str:
    by = {s.side: s for s in report.sides}
    cols = [by[s] for s in SIDES if s in by]
    verdict = "PASS" if report.ok else "FAIL"

    def row(title: str, cells: list[str]) -> str:
        return f"| {title} | " + " | ".join(cells) + " |"

    def num(v: float) -> str:
        return f"{v:,.0f}"

    lines = [
        f"# MoRIIO E2E A/B: {verdict}",
        "",
        f"`{report.name}`, launcher {report.launcher}: the base and the overlay "
        "image on the same nodes, one after the other. On the base, the "
        "failures the rules predict are expected.",
        "",
        row("", [c.side for c in cols]),
        "|---|" + "---|" * len(cols),
        row("image", [f"`{c.image}`" for c in cols]),
        row("series", [c.series_id or "unknown" for c in cols]),
        row("stopped early", [c.error or "no" for c in cols]),
        row("banner as expected", ["yes" if c.banner_ok else "NO" for c in cols]),
        row("lengths wrong", [f"{_few(c.wrong)} of {c.prompts}" for c in cols]),
        row("of which predicted", [_few(c.predicted) for c in cols]),
        row("unexpected", [_few(c.unexpected) for c in cols]),
        row("predicted but passed", [_few(c.predicted_but_passed) for c in cols]),
        row("KV tokens loaded (decoder counters)", [num(c.kv_tokens) for c in cols]),
        row("KV bytes (tokens x kv_bytes_per_token)", [num(c.kv_bytes) for c in cols]),
        row(
            "NIC bytes received by the decode nodes",
            [num(c.nic_bytes) if c.nic_bytes >= 0 else "not read" for c in cols],
        ),
        *load_rows(cols, row),
        row("verdict", ["as predicted" if c.ok else "FAIL" for c in cols]),
        row("report", [c.report for c in cols]),
        "",
    ]
    return "\n".join(lines)


def load_rows(cols: list[AbSide], row: Callable[[str, list[str]], str]) -> list[str]:
    """TTFT/TPOT/ITL p50/p99 of every load cell, side by side."""
    keys = (
        [(c.input_len, c.output_len, c.concurrency) for c in cols[0].load]
        if cols
        else []
    )
    out = []
    for isl, osl, conc in keys:
        cells = []
        for side in cols:
            cell = next(
                (x for x in side.load if (x.input_len, x.output_len, x.concurrency)
                 == (isl, osl, conc)),
                None,
            )  # fmt: skip
            r = cell.result if cell else None
            cells.append(
                f"TTFT {r.p50_ttft_ms:.1f}/{r.p99_ttft_ms:.1f}, TPOT "
                f"{r.p50_tpot_ms:.2f}/{r.p99_tpot_ms:.2f}, ITL "
                f"{r.p50_itl_ms:.2f}/{r.p99_itl_ms:.2f}"
                if r is not None
                else (cell.error if cell else "not run")
            )
        out.append(row(f"load {isl}/{osl} c{conc}: p50/p99 ms", cells))
    return out


def write_ab(report: AbReport, run_dir: Path) -> tuple[Path, Path]:
    run_dir.mkdir(parents=True, exist_ok=True)
    js, md = run_dir / "ab.json", run_dir / "ab.md"
    replace_file(js, msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")
    replace_file(md, markdown(report).encode())
    return js, md


def summary_line(report: AbReport) -> str:
    parts = [
        f"{s.side} {len(s.wrong)} wrong ({len(s.predicted)} predicted, "
        f"{len(s.unexpected)} unexpected)"
        for s in report.sides
    ]
    return f"e2e A/B {report.name}: {'PASS' if report.ok else 'FAIL'}; " + "; ".join(
        parts
    )


def run_ab(
    config: RunConfig,
    run_dir: Path,
    overlay_series: str,
    say: Callable[[str], None],
    launcher_kind: LauncherKind = "ssh",
    preflight: str = "",
) -> AbReport:
    """The base, then the overlay, each a whole run under ``run_dir/SIDE``;
    an interruption of the base run starts no overlay run."""

    done: list[AbSide] = []
    for side, cfg in side_configs(config).items():
        say(f"e2e A/B: the {side} image {cfg.container.image}")
        report = run(
            cfg, run_dir / side, expected_series(side, overlay_series), say=say,
            launcher_kind=launcher_kind, preflight=preflight,
        )  # fmt: skip
        done.append(side_of(side, report, run_dir / side / "report.md"))
        if report.error.startswith(("Terminated", "KeyboardInterrupt")):
            say("e2e A/B: interrupted: the next image is not started")
            break
    ab = AbReport(config.name, launcher_kind, done)
    js, md = write_ab(ab, run_dir)
    say(f"e2e A/B: side by side in {md} and {js}")
    return ab
