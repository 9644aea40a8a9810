"""`vllm-overlay e2e --config F [--launcher ssh|slurm] [--dry-run] [--run-dir D]`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import time
from pathlib import Path

import msgspec

from vllm_overlay.command import App, Subparsers, add_command
from vllm_overlay.cpuplatform import cpu_environ
from vllm_overlay.e2e.ab import run_ab, side_configs
from vllm_overlay.e2e.ab import summary_line as ab_summary_line
from vllm_overlay.e2e.config import RunConfig, load_config
from vllm_overlay.e2e.deploy import serve_text
from vllm_overlay.e2e.expect import Expectations, Geometry, prefix_read, sweep_lengths
from vllm_overlay.e2e.lws import manifest
from vllm_overlay.e2e.plan import build_plan, format_plan
from vllm_overlay.e2e.preflight import Preflight, PreflightError
from vllm_overlay.e2e.preflight import text_lines as preflight_lines
from vllm_overlay.e2e.reap import reap_containers, reap_jobs
from vllm_overlay.e2e.runid import owner, run_name, run_prefix, with_run_id
from vllm_overlay.e2e.runner import check_prerequisites, config_endpoints, run
from vllm_overlay.e2e.servers import servers
from vllm_overlay.e2e.slurm import SlurmJob, dry_run_lines
from vllm_overlay.errors import OverlayError
from vllm_overlay.text import count

LAUNCHERS = ("ssh", "slurm", "attach")
RUN_ID = re.compile(r"[a-z0-9]{1,16}")
NO_PREFLIGHT = (
    "skipped (--no-preflight): the config's [layout] is taken as "
    "typed, nothing checked what vLLM builds"
)


def lengths_text(lengths: list[int], limit: int = 400) -> str:
    text = " ".join(map(str, lengths))
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def series_patches(app: App | None = None) -> tuple[str, list[str]] | None:
    """The series id and patch names of the overlay checkout this runs from."""
    try:
        series = (app or App()).checkout.series
    except OverlayError:
        return None
    return series.series_id, [p.name for p in series.patches]


def expectation_lines(
    config: RunConfig, lengths: list[int], found: tuple[str, list[str]] | None
) -> list[str]:
    """Which lengths fail on the base image and why; what the overlay of this
    checkout leaves."""
    geo = Geometry.of(config)
    base = Expectations(geo, [])
    over = Expectations(geo, None if found is None else found[1])
    lines = [f"layout: {geo.describe()}"]
    if base.refusals:
        lines.append(
            f"expected on the base image (vLLM {base.base_version} without the "
            "series): the servers refuse to start, so every check fails:"
        )
        lines += [f"  {r.id}: {r.summary}; {r.fix_text()}" for r in base.refusals]
    failing = [n for n in lengths if base.verdict(n).base]
    if base.rules and not base.refusals:
        lines.append(
            f"expected on the base image (vLLM {base.base_version} without the "
            f"series): {len(failing)} of {len(lengths)} lengths read wrong KV:"
        )
        for r in base.rules:
            hit = [n for n in lengths if r.applies(n)]
            lines.append(f"  {r.id} [{r.summary}; {r.fix_text()}]:")
            lines.append(f"    {len(hit)} lengths: {lengths_text(hit)}")
    elif not base.refusals and geo.hybrid:
        lines.append(
            f"expected on the base image: no length fails; vLLM {base.base_version}'s "
            "connector starts this hybrid READ layout (the simulator's verdict) "
            "and the rules give no wrong-KV length for hybrid READ: the checks "
            "show whether the real model agrees"
        )
    elif not base.refusals:
        lines.append(
            "expected on the base image: no length fails; this layout has none "
            "of the mechanisms the series fixes (a smoke test: base and overlay "
            "both pass)"
        )
    if base.not_modelled:
        lines.append(f"not modelled: {base.not_modelled}")
    which = "the overlay" if found is None else f"the overlay (series {found[0]})"
    refused = over.refused_overlaid
    if refused:
        lines.append(f"expected with {which}: still refused at start:")
        lines += [f"  {r.id}: {r.summary}" for r in refused]
    else:
        still = [n for n in lengths if over.verdict(n).overlay]
        ids = sorted({i for n in still for i in over.verdict(n).overlay})
        lines.append(
            f"expected with {which}: {len(still)} lengths fail"
            + (f" ({', '.join(ids)}): {lengths_text(still)}" if still else "")
        )
    return lines


def check_lines(
    config: RunConfig,
    front: str,
    direct: str,
    decode: list[str],
    found: tuple[str, list[str]] | None,
) -> list[str]:
    c = config.checks
    r = config.router
    geo = Geometry.of(config)
    lengths = sweep_lengths(geo, c)
    lines = [
        f"[harness] front end {r.kind} at {front}: the first P/D request "
        "(max_tokens 4, ignore_eos) is retried until it answers, and tells whether "
        f"the decoder gets max_tokens or one fewer (configured: {r.max_tokens}); "
        "P/D requests then ask for that many more, so both paths answer "
        f"{c.max_tokens} tokens",
        f"[harness] every prompt: POST {front}/v1/completions (P/D) and "
        f"{direct}/v1/completions (direct prefill), greedy, {c.max_tokens} tokens, "
        f"prompt as token ids from {config.model.tokenizer}",
        "[harness] around every P/D request: GET /metrics of " + ", ".join(decode),
        f"prompt-length sweep: {len(lengths)} key-value prompts (page boundaries "
        f"with offsets {c.boundary_offsets}, every residue class of the rules "
        f"below, {len(c.lengths)} listed lengths): {lengths_text(lengths, 10**6)}",
        *expectation_lines(config, lengths, found),
        f"needle in a haystack: {', '.join(map(str, c.needle_words))} words",
        f"full-local-hit repeat: one {c.repeat_length}-token prompt through P/D, "
        f"then {count(config.decode.count, 'time')} again (round robin brings it back "
        "to a decoder that holds it)",
    ]
    for f in c.prefix_hit_fractions:
        r_ = prefix_read(geo, c.prefix_hit_length, int(c.prefix_hit_length * f))
        pages = f"the base reads {r_.pages_base} attention pages per group"
        if r_.pages_overlay != r_.pages_base:
            pages += f", the series {r_.pages_overlay}"
        lines.append(
            f"prefix-hit transfer: two {c.prefix_hit_length}-token prompts sharing "
            f"{f:.1%}: the decoder holds {r_.local_hit} tokens, loads "
            f"{r_.external}; {pages}"
        )
    a = c.accuracy
    if a.problems:
        lines.append(
            f"accuracy: {a.problems} generated GSM8K-style problems, {a.shots} "
            f"worked examples, P/D >= {a.threshold:g} and at most {a.max_drop:g} "
            "below the direct prefill"
        )
    return lines


def summary_line(
    config: RunConfig, launcher: str, found: tuple[str, list[str]] | None
) -> str:
    """The dry run's last line: the topology and the expected verdicts."""
    geo = Geometry.of(config)
    lengths = sweep_lengths(geo, config.checks)
    base = Expectations(geo, [])
    over = Expectations(geo, None if found is None else found[1])

    def verdict(exp: Expectations, refused: bool, field: str) -> str:
        if refused:
            return "refused at start"
        failing = [n for n in lengths if getattr(exp.verdict(n), field)]
        return f"{len(failing)} expected to fail"

    return (
        f"e2e dry run {config.name}: {config.prefill.count} prefill x "
        f"{config.decode.count} decode, launcher {launcher}, {len(lengths)} sweep "
        f"lengths; base image: {verdict(base, bool(base.refusals), 'base')}; "
        f"overlay: {verdict(over, bool(over.refused_overlaid), 'overlay')}"
    )


def missing_local_files(config: RunConfig) -> list[str]:
    """The config's paths on the machine running the harness (this one)
    that do not exist: the real run would stop there before launching."""
    path = Path(config.model.tokenizer)
    if path.is_file():
        return []
    return [
        f"model.tokenizer {path}: no such file here; the harness loads it on "
        "this machine before anything starts, so the run would stop there"
    ]


def dry_run_text(
    config_path: Path,
    launcher: str = "ssh",
    run_dir: Path | None = None,
    app: App | None = None,
    run_id: str = "",
) -> str:
    """Every command in order, what the checks send, the lengths expected to
    fail on the base image and with this checkout's series; a summary."""
    config = with_run_id(load_config(config_path), run_id)
    found = series_patches(app)
    plan = plan_text(config, launcher, run_dir, found)
    return plan + summary_line(config, launcher, found) + "\n"


def ab_dry_run_text(
    config_path: Path,
    launcher: str = "ssh",
    run_dir: Path | None = None,
    app: App | None = None,
    run_id: str = "",
) -> str:
    """`--dry-run --ab`: the base's plan, the overlay's plan, what differs
    between them, and a summary of both images' expected failures."""

    config = load_config(config_path)
    found = series_patches(app)
    sides = side_configs(config, run_id)
    out: list[str] = []
    for side, cfg in sides.items():
        out.append(f"# ===== A/B, the {side} image: {cfg.container.image} =====")
        where = run_dir / side if run_dir else None
        out.append(plan_text(cfg, launcher, where, found).rstrip("\n"))
    out += ab_difference_lines(sides, found)
    geo = Geometry.of(config)
    lengths = sweep_lengths(geo, config.checks)
    counts = ab_expected(config, found)
    base, over = sides["base"].container.image, sides["overlay"].container.image
    out.append(
        f"e2e dry run {config.name} --ab: {config.prefill.count} prefill x "
        f"{config.decode.count} decode, launcher {launcher}, {len(lengths)} sweep "
        f"lengths on both images, one after the other; base {base}: "
        f"{counts['base']}; overlay {over}: {counts['overlay']}"
    )
    return "\n".join(out) + "\n"


def ab_expected(
    config: RunConfig, found: tuple[str, list[str]] | None
) -> dict[str, str]:
    """Each image's expected failures, in a few words."""
    geo = Geometry.of(config)
    lengths = sweep_lengths(geo, config.checks)
    out: dict[str, str] = {}
    for side, patches in (
        ("base", []),
        ("overlay", None if found is None else found[1]),
    ):
        exp = Expectations(geo, patches)
        refused = exp.refusals if side == "base" else exp.refused_overlaid
        field = "base" if side == "base" else "overlay"
        failing = [n for n in lengths if getattr(exp.verdict(n), field)]
        out[side] = (
            "refused at start" if refused else f"{len(failing)} expected to fail"
        )
    return out


def ab_difference_lines(
    sides: dict[str, RunConfig], found: tuple[str, list[str]] | None
) -> list[str]:
    """What differs between the two runs of `--ab`, and why."""

    base, over = sides["base"], sides["overlay"]
    geo = Geometry.of(over)
    lengths = sweep_lengths(geo, over.checks)
    b = Expectations(geo, [])
    o = Expectations(geo, None if found is None else found[1])
    wrong_b = [n for n in lengths if b.verdict(n).base]
    wrong_o = [n for n in lengths if o.verdict(n).overlay]
    series = found[0] if found else "unknown"
    lines = [
        "# ===== A/B: what differs (same nodes, config and checks; base first) =====",
        f"- image: base {base.container.image} (`image build --series none`), "
        f"overlay {over.container.image}",
        f"- containers: base {run_name(base)}-*, overlay {run_name(over)}-*",
        "- banner every server must log: base `no overlay manifest` (the base's "
        f"MoRIIO files), overlay series {series}",
    ]
    for side, exp, wrong in (("base", b, wrong_b), ("overlay", o, wrong_o)):
        refused = exp.refusals if side == "base" else exp.refused_overlaid
        if refused:
            lines.append(
                f"- {side}: refused at start: " + "; ".join(r.summary for r in refused)
            )
            continue
        ids = sorted({i for n in wrong for i in getattr(exp.verdict(n), side)})
        lines.append(
            f"- {side}: {len(wrong)} of {len(lengths)} lengths expected wrong"
            + (f" ({', '.join(ids)}): {lengths_text(wrong)}" if wrong else "")
        )
    only_base = [n for n in wrong_b if n not in wrong_o]
    lines += [
        f"- fixed by the series: {len(only_base)} lengths"
        + (f": {lengths_text(only_base)}" if only_base else ""),
        "- on the base, the predicted failures are expected: the A/B verdict "
        "fails only on an unexpected failure of either image or a run that "
        "stopped early",
        "- side by side in RUN_DIR/ab.md: lengths wrong, KV tokens and bytes "
        "moved, NIC bytes received by the decode nodes, serving figures",
    ]
    return lines


def plan_text(
    config: RunConfig,
    launcher: str,
    run_dir: Path | None,
    found: tuple[str, list[str]] | None,
) -> str:
    if launcher == "slurm":
        job = SlurmJob(config, run_dir or Path("runs") / f"{config.name}-RUN")
        r = config.router
        front = f"http://<{'router' if r.container else r.address}>:{r.port}"
        urls = [f"http://<{s.name}>:{s.http_port}" for s in servers(config)]
        decode = [u for u in urls if "<decode" in u]
        checks = check_lines(config, front, urls[0], decode, found)
        head = f"# e2e slurm plan {config.name}: image {config.container.image}"
        body = [*dry_run_lines(job), "## checks", *(f"- {x}" for x in checks)]
        return "\n".join([head, *body]) + "\n"

    plan = build_plan(config)
    if launcher == "attach":
        plan = plan.attach()
    ends = config_endpoints(config)
    checks = check_lines(config, ends.front, ends.direct, ends.decode, found)
    return format_plan(plan, checks)


def cmd_e2e(app: App, args: argparse.Namespace) -> int:
    """MoRIIO READ P/D on real nodes: P/D vs direct prefill, token for token.

    Start N prefill and M decode vLLM servers of the overlay image with the
    MoRIIO connector in READ mode and a front end (over ssh, or as one Slurm
    job), send every check's prompts through P/D and to a prefill server
    alone, compare token for token, and write a report. The dry run prints
    every command and the prompt lengths expected to fail on the base image,
    and why.
    """
    if args.preflight:
        result = run_preflight(args.config)
        for line in preflight_lines(result):
            app.say(line)
        app.result(result)
        return result.exit_status
    if args.reap:
        return reap(app, load_config(args.config), args.launcher)
    if args.print_serve:
        app.say(serve_text(load_config(args.config)).rstrip("\n"))
        return 0
    if args.emit == "lws":
        app.say(json.dumps(manifest(load_config(args.config)), indent=2))
        return 0
    if args.ab and args.launcher == "attach":
        raise OverlayError("--ab starts both images: not with --launcher attach")
    if args.dry_run:
        make = ab_dry_run_text if args.ab else dry_run_text
        text = make(args.config, args.launcher, args.run_dir, app, args.run_id or "")
        plan, summary = text.rstrip("\n").rsplit("\n", 1)
        app.say(plan)
        # Warnings before the summary, which stays the last line.
        app.out.flush()
        for line in missing_local_files(load_config(args.config)):
            app.err.write(f"warning: {line}\n")
        app.err.flush()
        app.say(summary)
        return 0

    config = with_run_id(load_config(args.config), args.run_id or "")
    if args.launcher != "slurm":
        config.check_addresses()
    # What this machine needs for the run (the e2e extra, the secrets), said
    # before the preflight, which takes a minute.
    check_prerequisites(config, args.launcher)
    if args.no_preflight:
        preflight = NO_PREFLIGHT
        app.say(f"e2e: preflight {preflight}")
    else:
        # The first step of every real run: nothing starts unless vLLM, on
        # CPU, builds both legs as the checks need them.
        checked = run_preflight(args.config)
        for line in preflight_lines(checked):
            app.say(line)
        if checked.unchecked:
            raise OverlayError(
                f"{config.name}: the preflight could not check the config "
                f"({checked.unchecked}); nothing was started"
            )
        if not checked.ok:
            raise OverlayError(
                f"{config.name}: the preflight refused the config "
                f"({checked.findings[0]}); nothing was started"
            )
        if checked.layout is not None:
            config = msgspec.structs.replace(config, layout=checked.layout)
        preflight = "passed (the [layout] the checks read is the one vLLM builds)"
    run_dir = (
        args.run_dir or Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    found = series_patches(app)
    if args.ab:
        ab = run_ab(
            config, run_dir, found[0] if found else "", app.say, args.launcher,
            preflight,
        )  # fmt: skip
        app.result(ab)
        app.say(ab_summary_line(ab))
        return 0 if ab.ok else 1
    report = run(
        config, run_dir, found[0] if found else "", say=app.say,
        launcher_kind=args.launcher, preflight=preflight,
    )  # fmt: skip
    app.result(report)
    return 0 if report.ok else 1


def reap(app: App, config: RunConfig, launcher: str) -> int:
    """Remove the stale containers (Slurm: cancel the jobs) of this user's
    earlier runs of ``config``; exit 1 when a host could not be asked."""

    if launcher == "attach":
        raise OverlayError("--reap: the attach launcher starts nothing to reap")
    t = config.timeouts.command_s
    done = (
        reap_jobs(config, app.say, t)
        if launcher == "slurm"
        else reap_containers(config, app.say, t)
    )
    for line in done.failed:
        app.say(f"e2e reap: could not reap on {line}")
    what = "Slurm job" if launcher == "slurm" else "stale container"
    app.say(
        f"e2e reap {config.name}: {count(len(done.removed), what)} of {owner()}'s "
        f"runs ({run_prefix(config)}-*) removed"
        + (f"; {count(len(done.failed), 'failure')}" if done.failed else "")
    )
    return 1 if done.failed else 0


def run_id_arg(value: str) -> str:
    if not RUN_ID.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value!r}: a run id is 1 to 16 lower-case letters and digits"
        )
    return value


def run_preflight(config_path: Path) -> Preflight:
    """The CPU preflight (preflight_vllm.py): here when this Python has vLLM,
    else in the Python ``$VLLM_OVERLAY_PREFLIGHT_PYTHON`` names or the
    checkout's ``.venv`` (``nox -s dev``), whose JSON result is read back."""
    if importlib.util.find_spec("vllm") is not None:
        # The one import of ours inside a function: the e2e CLI runs where
        # vLLM is absent, and only the preflight module may reach for it.
        from vllm_overlay.e2e.preflight_vllm import preflight

        return preflight(config_path)
    python = os.environ.get("VLLM_OVERLAY_PREFLIGHT_PYTHON") or str(
        Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
    )
    if not Path(python).is_file():
        raise PreflightError(
            f"the preflight needs vLLM (CPU): {python} does not exist; run "
            "`nox -s dev` or set VLLM_OVERLAY_PREFLIGHT_PYTHON"
        )
    argv = [python, "-m", "vllm_overlay.cli", "--json", "e2e", "--config",
            str(config_path), "--preflight"]  # fmt: skip
    # vLLM on the overlay's CPU platform (vllm_overlay/cpuplatform): an
    # explicit VLLM_TARGET_DEVICE=cpu would take vLLM's own, which 0.34.0
    # refuses on x86 without triton-cpu.
    env = {**cpu_environ(), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, capture_output=True, env=env, check=False)
    try:
        return msgspec.json.decode(done.stdout, type=Preflight)
    except msgspec.DecodeError:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
        raise PreflightError(
            f"the preflight in {python} failed (exit {done.returncode}): "
            f"{tail[0] if tail else 'no output'}"
        ) from None


def register(sub: Subparsers) -> None:
    p = add_command(sub, "e2e", cmd_e2e)
    p.add_argument(
        "--config", type=Path, required=True, metavar="TOML", help="the run config"
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="ssh",
        help="ssh: every address in the config, commands over ssh (default); "
        "slurm: submit one sbatch job, one task per server node; attach: the "
        "servers already run (e.g. from --emit lws), only check them",
    )
    p.add_argument(
        "--emit",
        choices=("lws",),
        help="print a Kubernetes manifest (a LeaderWorkerSet per side) and exit",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print every command, launch nothing"
    )
    p.add_argument(
        "--preflight",
        action="store_true",
        help="on CPU, build each server's engine config, KV cache groups and "
        "ROCm attention backends with vLLM's own code and check them (block "
        "sizes, drafters, layout, check lengths); launch nothing. Every real "
        "run does this first",
    )
    p.add_argument(
        "--no-preflight",
        action="store_true",
        help="run without the preflight (for a fake engine, or a config whose "
        "preflight passed elsewhere); the run and its report say it was skipped",
    )
    p.add_argument(
        "--print-serve",
        action="store_true",
        help="print the commands that start the front end and every server "
        "(the container flags, RDMA env and `vllm serve` lines of the run), "
        "launch nothing",
    )
    p.add_argument(
        "--run-id",
        type=run_id_arg,
        metavar="ID",
        help="the run's id in its container names and labels (default: a "
        "fresh one per run)",
    )
    p.add_argument(
        "--ab",
        action="store_true",
        help="run the base image (`image build --series none`, "
        "container.base_image) and then the overlay image on the same nodes, "
        "and report side by side the lengths each gets wrong and the bytes "
        "each moves; with --dry-run, both plans and what differs",
    )
    p.add_argument(
        "--reap",
        action="store_true",
        help="remove the containers of your earlier runs of this config left "
        "on its nodes (found by label: your user and the config's name; with "
        "--launcher slurm, cancel your jobs of it); a run never does this by "
        "itself",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="report directory (default: runs/NAME-TIME)",
    )
