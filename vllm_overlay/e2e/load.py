"""The load phase: `vllm bench serve` against the front end at every input
length and concurrency of `[load]`, run in a throwaway container of the
image on the front end's host; TTFT/TPOT/ITL percentiles read from the
JSON result file it saves (printed on stdout by the container, so no file
is left on the node). In a Slurm job the bench runs as a job step on the
front end's node, its secrets from the front end's env file."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import msgspec

from vllm_overlay.e2e.checks import Case, Section, section_status
from vllm_overlay.e2e.config import Reach, RunConfig
from vllm_overlay.e2e.launch import LaunchError, run_command
from vllm_overlay.e2e.plan import on_host, where, with_secrets
from vllm_overlay.e2e.runid import label_flags
from vllm_overlay.e2e.secret import secret_names
from vllm_overlay.e2e.servers import container_name, env_flags

PERCENTILES = (50, 90, 99)
RESULT = "/tmp/bench/result.json"


class BenchResult(msgspec.Struct):
    """What the harness reads of `vllm bench serve --save-result`'s JSON
    (vLLM's benchmarks/serve.py keys; the file holds more)."""

    completed: int
    duration: float
    request_throughput: float
    output_throughput: float
    failed: int = 0
    mean_ttft_ms: float = 0.0
    p50_ttft_ms: float = 0.0
    p90_ttft_ms: float = 0.0
    p99_ttft_ms: float = 0.0
    mean_tpot_ms: float = 0.0
    p50_tpot_ms: float = 0.0
    p90_tpot_ms: float = 0.0
    p99_tpot_ms: float = 0.0
    mean_itl_ms: float = 0.0
    p50_itl_ms: float = 0.0
    p90_itl_ms: float = 0.0
    p99_itl_ms: float = 0.0


class LoadResult(msgspec.Struct, forbid_unknown_fields=True):
    """One cell of the load phase, in the report."""

    input_len: int
    output_len: int
    concurrency: int
    prompts: int
    error: str = ""  # the bench did not run or gave no result
    result: BenchResult | None = None

    @property
    def id(self) -> str:
        return f"isl{self.input_len}-osl{self.output_len}-c{self.concurrency}"

    @property
    def ok(self) -> bool:
        r = self.result
        return not self.error and r is not None and r.completed == self.prompts

    def describe(self) -> str:
        r = self.result
        if r is None:
            return self.error
        return (
            f"{r.completed}/{self.prompts} completed ({r.failed} failed) in "
            f"{r.duration:.1f} s, {r.request_throughput:.2f} req/s, "
            f"{r.output_throughput:.0f} out tok/s; TTFT p50/p90/p99 "
            f"{r.p50_ttft_ms:.1f}/{r.p90_ttft_ms:.1f}/{r.p99_ttft_ms:.1f} ms, TPOT "
            f"{r.p50_tpot_ms:.2f}/{r.p90_tpot_ms:.2f}/{r.p99_tpot_ms:.2f} ms, ITL "
            f"{r.p50_itl_ms:.2f}/{r.p90_itl_ms:.2f}/{r.p99_itl_ms:.2f} ms"
        )


def cells(config: RunConfig) -> list[LoadResult]:
    load = config.load
    if not load.enabled:
        return []
    return [
        LoadResult(isl, load.output_len, c, c * load.prompts_per_concurrency)
        for isl in load.input_lens
        for c in load.concurrencies
    ]


def bench_argv(
    config: RunConfig, cell: LoadResult, front: str, env_file: str = ""
) -> list[str]:
    """`docker run` of one cell: `vllm bench serve` saves its result in the
    container, which prints it on stdout (the progress goes to stderr)."""
    c, m = config.container, config.model
    bench = [
        "bench", "serve", "--backend", "vllm", "--base-url", front,
        "--model", m.served_name, "--tokenizer", m.path,
        "--dataset-name", "random", "--random-input-len", str(cell.input_len),
        "--random-output-len", str(cell.output_len), "--ignore-eos",
        "--num-prompts", str(cell.prompts), "--max-concurrency", str(cell.concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        "--seed", str(config.load.seed), "--save-result",
        "--result-dir", RESULT.rsplit("/", 1)[0],
        "--result-filename", RESULT.rsplit("/", 1)[1],
    ]  # fmt: skip
    script = f'vllm "$@" 1>&2 && cat {shlex.quote(RESULT)}'
    argv = [
        c.engine,
        "run",
        "--rm",
        "--name",
        container_name(config, f"bench-{cell.id}"),
    ]
    argv += [*label_flags(config), "--network", "host"]
    for volume in c.volumes:
        argv += ["--volume", volume]
    argv += env_flags(c.env, env_file)
    return [*argv, "--entrypoint", "sh", c.image, "-c", script, "sh", *bench]


class BenchHost(NamedTuple):
    """Where the bench runs and how a command gets there; ``env_file``: the
    file its secrets come from ("": read on its stdin)."""

    where: str
    place: Callable[[list[str]], list[str]]
    env_file: str = ""


def front_host(config: RunConfig) -> BenchHost:
    """The front end's host (its container's, or this node for a front end
    the harness runs), reached as the front end is."""
    r = config.router
    reach = r.reach if r.container else Reach()
    return BenchHost(where(reach), partial(on_host, reach))


def run_load(
    config: RunConfig,
    front: str,
    secrets: dict[str, str],
    say: Callable[[str], None],
    host: BenchHost | None = None,
) -> list[LoadResult]:
    """Every cell in turn; a cell that fails is recorded and the next runs.
    ``host`` defaults to `front_host`."""
    host = host or front_host(config)
    names = [] if host.env_file else secret_names(config.container.env)
    stdin = "".join(f"{secrets[n]}\n" for n in names).encode() if names else None
    out: list[LoadResult] = []
    for cell in cells(config):
        bench = bench_argv(config, cell, front, host.env_file)
        argv = host.place(with_secrets(bench, names))
        say(
            f"[load @ {host.where}] vllm bench serve: ISL {cell.input_len} OSL "
            f"{cell.output_len}, concurrency {cell.concurrency}, {cell.prompts} prompts"
        )
        try:
            done = run_command(argv, config.load.timeout_s, stdin)
        except LaunchError as e:
            cell.error = str(e)
            out.append(cell)
            continue
        try:
            cell.result = msgspec.json.decode(done.stdout, type=BenchResult)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
            head = done.stdout.decode(errors="replace").strip()[:80]
            cell.error = (
                f"exit {done.returncode}, no result ({e}; stdout {head!r}): "
                f"{tail[0] if tail else ''}"
            )
        say(f"[load] {cell.id}: {cell.describe()}")
        out.append(cell)
    return out


def load_section(results: list[LoadResult], skipped: str = "") -> Section:
    """One case per cell: it passes when every request completed."""
    if skipped:
        return Section("serving load", "skip", [Case("load", "skip", skipped)])
    cases = [
        Case(r.id, "pass" if r.ok else "fail", r.describe(), r.input_len)
        for r in results
    ]
    summary: dict[str, float | int | str] = {"cells": len(results)}
    return Section("serving load", section_status(cases), cases, summary)
