"""One E2E run: launch every server, send every check's prompts through
P/D and directly to a prefill server, judge, report."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol, Self

from vllm_overlay.e2e import accuracy
from vllm_overlay.e2e.checks import (
    Exchange,
    Section,
    Transfer,
    accuracy_section,
    front_end_section,
    image_series,
    launch_section,
    needle_section,
    overlay_section,
    prefix_section,
    repeat_section,
    sweep_section,
    transfer_section,
)
from vllm_overlay.e2e.client import (
    EXTERNAL_HITS,
    LOCAL_HITS,
    Completion,
    complete,
    scrape_all,
)
from vllm_overlay.e2e.config import RunConfig, encode_config
from vllm_overlay.e2e.expect import (
    Expectations,
    Geometry,
    PrefixRead,
    prefix_read,
    sweep_lengths,
)
from vllm_overlay.e2e.launch import (
    ContainerState,
    Endpoints,
    HealthTimeout,
    Launcher,
    LaunchError,
    Terminated,
    sigterm_raises,
)
from vllm_overlay.e2e.load import LoadResult, load_section, run_load
from vllm_overlay.e2e.nic import NicCounters, moved
from vllm_overlay.e2e.plan import Plan, build_plan
from vllm_overlay.e2e.prompts import (
    Prompt,
    encode,
    kv_prompt,
    load_tokenizer,
    needle_prompt,
    prefix_pair,
    probe_prompt,
    special_prefix,
    sweep_prompts,
)
from vllm_overlay.e2e.report import Report, write_report
from vllm_overlay.e2e.runid import run_name, with_run_id
from vllm_overlay.e2e.secret import all_values, masking, scrub
from vllm_overlay.e2e.servers import leg_secrets, node_secrets, servers
from vllm_overlay.e2e.slurm import SlurmLauncher

LauncherKind = Literal["ssh", "slurm", "attach"]
NOT_SENT = Completion([], "", 0, error="not sent")
PROBE_TOKENS = 4


class RunLauncher(Protocol):
    """What the runner needs from a launcher (ssh/local or Slurm): start
    everything, tell whether it still runs, tear down on leaving."""

    log_dir: Path
    stopped: list[ContainerState]

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def setup(self) -> Endpoints: ...

    def check_alive(self) -> None: ...


def planned_lengths(config: RunConfig) -> list[int]:
    return sweep_lengths(Geometry.of(config), config.checks)


def config_endpoints(config: RunConfig) -> Endpoints:
    """Where the servers of an ssh-launched run answer (addresses known)."""
    r = config.router
    pre = [s.url for s in servers(config, "prefill")]
    dec = [s.url for s in servers(config, "decode")]
    return Endpoints(f"http://{r.address}:{r.port}", pre[0], pre, dec)


def make_launcher(
    config: RunConfig,
    run_dir: Path,
    kind: LauncherKind,
    say: Callable[[str], None],
    plan: Plan | None = None,
) -> RunLauncher:
    if kind == "slurm":
        return SlurmLauncher(config, run_dir, say)
    t = config.timeouts
    if plan is None:
        plan = build_plan(config)
        if kind == "attach":
            plan = plan.attach()
    needs = any(s.secret_env for s in plan.steps)
    return Launcher(
        plan,
        run_dir / "logs",
        config_endpoints(config),
        t.poll_s,
        t.command_s,
        say,
        secrets=leg_secrets(config) if needs else None,
    )


def secret_values(config: RunConfig, kind: LauncherKind) -> set[str]:
    """Every secret value the run may hand a container (none for attach:
    it starts nothing), to be masked in what the run prints and writes."""
    if kind == "attach":
        return set()
    found = all_values(leg_secrets(config))
    if kind == "slurm":
        found |= all_values(node_secrets(config))
    return found


def scrub_logs(log_dir: Path, values: set[str]) -> None:
    """The run's log files with every secret value shown as ``***``."""
    if not values or not log_dir.is_dir():
        return
    for log in sorted(log_dir.glob("*.log")):
        text = log.read_text(errors="replace")
        clean = scrub(text, values)
        if clean != text:
            log.write_text(clean)


class Session:
    """Requests of one run, once everything is up."""

    def __init__(
        self,
        config: RunConfig,
        ends: Endpoints,
        launcher: RunLauncher,
        nic: NicCounters | None = None,
    ) -> None:
        self.config = config
        self.ends = ends
        self.launcher = launcher
        self.nic = nic
        self.shift = 0  # tokens the front end takes off the decoder's max_tokens
        self.measured = ""

    def detect_front_end(self, prompt: Prompt, say: Callable[[str], None]) -> None:
        """The first P/D request: retried until the front end serves (its
        servers registered), then it tells what max_tokens the decoder
        gets: all of them, or one fewer."""
        t = self.config.timeouts
        deadline = time.monotonic() + t.health_s
        name = self.config.model.served_name
        while True:
            answer = complete(
                self.ends.front, name, prompt.token_ids, PROBE_TOKENS, t.request_s,
                ignore_eos=True,
            )  # fmt: skip
            if not answer.error:
                break
            self.launcher.check_alive()
            if time.monotonic() >= deadline:
                raise HealthTimeout(
                    f"{self.ends.front}: no P/D answer after {t.health_s:g}s "
                    f"({answer.error[:200]})"
                )
            time.sleep(t.poll_s)
        n = len(answer.token_ids)
        if n == PROBE_TOKENS:
            self.measured, self.shift = "exact", 0
        elif n == PROBE_TOKENS - 1:
            self.measured, self.shift = "minus-one", 1
        else:
            raise LaunchError(
                f"front end answered {n} tokens for max_tokens={PROBE_TOKENS} "
                "with ignore_eos: neither exact nor minus-one"
            )
        say(f"e2e: front end {self.config.router.kind}: max_tokens {self.measured}")

    def complete_pair(
        self, prompt_ids: list[int], max_tokens: int, stop: list[str] | None = None
    ) -> tuple[Completion, Completion, Transfer | None]:
        """The P/D and the direct answer, and the decoders' counter deltas
        around the P/D request."""
        c = self.config
        t, name = c.timeouts, c.model.served_name
        before = scrape_all(self.ends.decode, t.request_s)
        nic_before = self.nic.read() if self.nic else None
        pd = complete(
            self.ends.front, name, prompt_ids, max_tokens + self.shift, t.request_s,
            stop=stop,
        )  # fmt: skip
        nic_after = self.nic.read() if self.nic else None
        after = scrape_all(self.ends.decode, t.request_s)
        direct = complete(
            self.ends.direct, name, prompt_ids, max_tokens, t.request_s, stop=stop
        )
        if pd.error or direct.error:
            self.launcher.check_alive()  # a dead server is the real error
        transfer = None
        if before is not None and after is not None:
            loaded = after[EXTERNAL_HITS] - before[EXTERNAL_HITS]
            transfer = Transfer(
                loaded,
                after[LOCAL_HITS] - before[LOCAL_HITS],
                int(loaded * c.model.kv_bytes_per_token),
                moved(nic_before, nic_after),
            )
        return pd, direct, transfer

    def exchange(self, prompt: Prompt) -> Exchange:
        c = self.config.checks
        ex = Exchange(
            prompt.id, prompt.kind, prompt.length, prompt.expected,
            pd=NOT_SENT, direct=NOT_SENT,
        )  # fmt: skip
        if prompt.length + c.max_tokens > self.config.model.max_model_len:
            ex.skipped = f"{prompt.length} tokens + answer exceed max_model_len"
            return ex
        ex.pd, ex.direct, ex.transfer = self.complete_pair(
            prompt.token_ids, c.max_tokens
        )
        return ex


def read_logs(log_dir: Path, names: list[str]) -> dict[str, str]:
    return {
        name: (log_dir / f"{name}.log").read_text(errors="replace")
        for name in names
        if (log_dir / f"{name}.log").is_file()
    }


def check_prerequisites(config: RunConfig, kind: LauncherKind) -> None:
    """What a run needs on this machine, each missing one a ``ConfigError``
    or ``SecretError``: the tokenizer (and the e2e extra that loads it), the
    value of every secret the run hands a container."""
    load_tokenizer(config.model.tokenizer)
    secret_values(config, kind)


def run(
    config: RunConfig,
    run_dir: Path,
    expected_series: str = "",
    say: Callable[[str], None] = print,
    plan: Plan | None = None,
    launcher_kind: LauncherKind = "ssh",
    preflight: str = "",
) -> Report:
    """Run every check; ``plan`` (ssh launcher) defaults to the config's;
    ``preflight`` says how the CLI's preflight ended (for the report)."""
    hidden = secret_values(config, launcher_kind)
    say = masking(say, hidden)
    # Every container of the run carries its id (name and label).
    config = with_run_id(config)
    if launcher_kind != "attach":
        say(f"e2e: run {config.container.run_id}: containers {run_name(config)}-*")
    c = config.checks
    tok = load_tokenizer(config.model.tokenizer)
    geo = Geometry.of(config)
    lengths = sweep_lengths(geo, c)
    sweep = sweep_prompts(tok, lengths, c.seed)
    needles = [needle_prompt(tok, w, c.seed) for w in c.needle_words]
    repeat = kv_prompt(tok, c.repeat_length, c.seed + 1)
    pairs = [
        prefix_pair(tok, c.prefix_hit_length, f, c.seed + i)
        for i, f in enumerate(c.prefix_hit_fractions)
    ]
    acc = c.accuracy
    problems = accuracy.prompts(acc.problems, acc.shots, c.seed)
    say(
        f"e2e: {len(sweep)} sweep prompts, {len(needles)} needles, 1 repeat, "
        f"{len(pairs)} prefix-hit pairs, {len(problems)} accuracy problems"
    )

    launcher = make_launcher(config, run_dir, launcher_kind, say, plan)
    sweep_ex: list[Exchange] = []
    needle_ex: list[Exchange] = []
    repeat_ex: list[Exchange] = []
    pair_ex: list[tuple[Exchange, Exchange]] = []
    pd_texts: list[str] = []
    direct_texts: list[str] = []
    acc_errors = 0
    load: list[LoadResult] = []
    session: Session | None = None
    error = ""
    try:
        with sigterm_raises(), launcher:
            ends = launcher.setup()
            slurm = launcher if isinstance(launcher, SlurmLauncher) else None
            nic = NicCounters(config, nodes=slurm.nic_nodes() if slurm else None)
            session = Session(config, ends, launcher, nic)
            session.detect_front_end(probe_prompt(tok), say)
            for group, prompts in ((sweep_ex, sweep), (needle_ex, needles)):
                for prompt in prompts:
                    group.append(session.exchange(prompt))
            say(f"e2e: sweep and needles done ({len(sweep_ex) + len(needle_ex)})")
            # With M decoders (round robin), a prompt sent M times has reached
            # every decoder: the next one finds it whichever serves it.
            decoders = len(ends.decode)
            repeat_ex = [session.exchange(repeat) for _ in range(decoders + 1)]
            for first, second in pairs:
                sent = [session.exchange(first) for _ in range(decoders)]
                pair_ex.append((sent[0], session.exchange(second)))
            for _, text in problems:
                ids = special_prefix(tok) + encode(tok, text)
                pd, direct, _ = session.complete_pair(
                    ids, acc.max_tokens, stop=[accuracy.STOP]
                )
                acc_errors += bool(pd.error or direct.error)
                # Scored on the answer decoded by the harness's tokenizer.
                pd_texts.append(tok.decode(pd.token_ids))
                direct_texts.append(tok.decode(direct.token_ids))
            if not load_skipped(config, launcher_kind):
                router_secrets = leg_secrets(config)["router"] if hidden else {}
                host = slurm.bench_host() if slurm else None
                load = run_load(config, ends.front, router_secrets, say, host)
    except (LaunchError, Terminated, KeyboardInterrupt) as e:
        error = f"{type(e).__name__}: {e}"

    scrub_logs(launcher.log_dir, hidden)
    names = [s.name for s in servers(config)]
    logs = read_logs(launcher.log_dir, names)
    patches = image_series(logs)
    expect = Expectations(geo, patches)
    notes = expectation_notes(expect, patches)
    sections: list[Section] = [
        launch_section(launcher.stopped, error),
        overlay_section(logs, expected_series),
    ]
    if not error and session is not None:
        predicted = {n: expect.verdict(n).overlay for n in lengths}
        scored = [p for p, _ in problems]
        reads = [
            prefix_read(geo, c.prefix_hit_length, int(c.prefix_hit_length * f))
            for f in c.prefix_hit_fractions
        ]
        sections += [
            front_end_section(
                config.router.kind, config.router.max_tokens, session.measured,
                session.shift,
            ),
            sweep_section(sweep_ex, predicted),
            needle_section(needle_ex),
            repeat_section(*repeat_ex),
            prefix_section(pair_ex, [read_note(r, geo, config) for r in reads]),
        ]  # fmt: skip
        if problems:
            sections.append(
                accuracy_section(
                    accuracy.score(pd_texts, scored),
                    accuracy.score(direct_texts, scored),
                    len(scored),
                    acc.threshold,
                    acc.max_drop,
                    acc_errors,
                )  # fmt: skip
            )
        exchanged = [
            *sweep_ex,
            *needle_ex,
            *repeat_ex,
            *(e for p in pair_ex for e in p),
        ]
        sections.append(transfer_section(exchanged))
        sections.append(load_section(load, load_skipped(config, launcher_kind)))
    series = str(sections[1].summary.get("series", "")) or expected_series
    report = Report(
        config.container.image, series, encode_config(config), sections, error,
        launcher=launcher_kind, front_end=config.router.kind, notes=notes,
        preflight=preflight, load=load, nic=nic_note(session),
    )  # fmt: skip
    js, md = write_report(report, run_dir, hidden)
    say(f"e2e: {'PASS' if report.ok else 'FAIL'}; report {md} and {js}")
    return report


def load_skipped(config: RunConfig, kind: LauncherKind) -> str:
    """Why the run has no load phase; "" when it has one."""
    if not config.load.enabled:
        return "load.enabled = false"
    if kind == "attach":
        return "the attach launcher runs no load phase (it starts no container)"
    return ""


def nic_note(session: Session | None) -> str:
    """Where the report's NIC bytes come from, or why there are none."""
    nic = session.nic if session else None
    if nic is None:
        return "not read (the run stopped before its first request)"
    if not nic.nodes:
        return "not read (nic.counters_root is empty)"
    if nic.failed:
        return f"not read: {nic.failed}"
    hosts = ", ".join(nic.nodes)
    return f"port_rcv_data deltas x 4 on the decode nodes ({hosts}), per P/D request"


def expectation_notes(expect: Expectations, patches: list[str] | None) -> list[str]:
    """What the rules predict for the image that ran."""
    which = (
        "an image of unknown series (the rules' own fixes assumed)"
        if patches is None
        else "the base image (no overlay)"
        if not patches
        else f"the overlay ({', '.join(patches)})"
    )
    notes = [f"expectations for {which}: layout {expect.geo.describe()}"]
    for r in expect.refused_overlaid:
        notes.append(f"refused at start: {r.summary} ({r.fix_text()})")
    for r in expect.rules:
        state = "passes (fixed)" if expect.fixed(r) else "fails"
        notes.append(f"{r.id}: {state}: {r.summary} ({r.fix_text()})")
    if expect.not_modelled:
        notes.append(f"not modelled: {expect.not_modelled}")
    return notes


def read_note(r: PrefixRead, geo: Geometry, config: RunConfig) -> str:
    """What a prefix-hit READ should move, per attention group."""
    page_bytes = config.layout.page_bytes or config.model.kv_bytes_per_token * geo.block
    text = (
        f"decoder hit {r.local_hit} of {r.length} tokens: the base reads "
        f"{r.pages_base} attention pages"
    )
    if r.pages_overlay != r.pages_base:
        text += f", the series {r.pages_overlay}"
    if page_bytes:
        text += f" ({page_bytes} bytes per page per rank)"
    return text
