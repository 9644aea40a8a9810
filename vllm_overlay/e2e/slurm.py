"""`--launcher slurm`: one sbatch job, one task per server node.

The job's batch step runs on its first node: it starts the front end there
(its address is every server's `proxy_ip`), then one `srun` fans out one
task per server. Task rank r runs server r of the config (prefill servers
first, then decode: the rank-to-role map is printed in the script), on its
node: it resolves the node's address, publishes it under the run directory,
pulls the image if needed and runs the server's container in the
foreground, removed on exit or cancel. The harness, on the submitting node,
reads the published addresses, waits for health while it watches the job's
state and every task's exit file, runs the checks, then cancels the job.
What runs on a node meanwhile (the NIC counter reads around every P/D
request, the load phase's bench on the front end's node) runs as a job step
there (`srun --jobid JOB --overlap --nodelist NODE`), so it needs no ssh.

The run directory must be on a filesystem every node shares with the
submitting node (as vLLM's ROCm P/D CI shares its log directory).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from vllm_overlay.e2e.config import IMAGE_UID, RENDER_GID, RunConfig
from vllm_overlay.e2e.launch import (
    STOP_GRACE_S,
    ClosedOnExit,
    ContainerExited,
    ContainerState,
    Endpoints,
    HealthTimeout,
    LaunchError,
    last_lines,
    probe,
    probe_tcp,
    resolve_executable,
    run_command,
    wait_all_healthy,
    wait_healthy,
)
from vllm_overlay.e2e.load import BenchHost
from vllm_overlay.e2e.nic import Place, devices_of
from vllm_overlay.e2e.plan import cache_command, pull_command
from vllm_overlay.e2e.runid import owner, run_name
from vllm_overlay.e2e.secret import MASK, is_secret, secret_names
from vllm_overlay.e2e.servers import (
    HOST_IP,
    PLACEHOLDERS,
    RENDER_GID_SH,
    Server,
    container_name,
    docker_run_router,
    docker_run_server,
    leg_secrets,
    node_secrets,
    router_command,
    servers,
    unplaced,
)

NODE_ENV = "@NODE_ENV@"  # the node's own env flags, filled in on the node
QUEUE_STATES = ("PENDING", "CONFIGURING", "RUNNING")
_SPLIT = re.compile("(" + "|".join(map(re.escape, [*PLACEHOLDERS, NODE_ENV])) + ")")


# The address of the interface a node routes ``$PEER_IP`` through.
_ROUTE_SRC = "ip -o -4 route get \"$PEER_IP\" | sed -n 's/.* src \\([0-9.]*\\).*/\\1/p'"
# The job's first node other than this one, and its IPv4 address.
_OTHER_NODE = (
    'PEER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" '
    '| grep -vx "${SLURMD_NODENAME:-$(hostname -s)}" | head -n 1)',
    "PEER_IP=$(getent ahostsv4 \"$PEER\" | awk '{print $1; exit}')",
)


def address_lines(config: RunConfig, var: str, front_end: bool) -> list[str]:
    """Shell lines setting ``var`` to this node's address: `address_command`
    when set; else `interface`'s IPv4 address; else that of the interface
    routing to the peer (a server's: the front end, ``$ROUTER_IP``; the
    front end's node: the job's next node). Never `hostname -I`'s first
    word, which may be any interface."""
    s = config.slurm
    if s.address_command:
        return [f"{var}=$({s.address_command})"]
    if s.interface:
        dev = shlex.quote(s.interface)
        return [
            f"{var}=$(ip -o -4 addr show dev {dev} "
            "| awk '{split($4, a, \"/\"); print a[1]; exit}')"
        ]
    peer = [*_OTHER_NODE] if front_end else ['PEER_IP="$ROUTER_IP"']
    return [*peer, f"{var}=$({_ROUTE_SRC})"]


def bash_word(word: str) -> str:
    """``word`` as one bash word; placeholders expand on the node."""
    if word == NODE_ENV:
        return '"${NODE_ENV[@]}"'
    out = []
    for part in _SPLIT.split(word):
        if part in PLACEHOLDERS:
            out.append('"${' + PLACEHOLDERS[part] + '}"')
        elif part:
            out.append(shlex.quote(part))
    return "".join(out) or "''"


def bash_line(argv: list[str]) -> str:
    return " ".join(bash_word(w) for w in argv)


def write_private(path: Path, text: str) -> None:
    """``path`` holding ``text``, readable by its owner only (0600 from
    the moment it exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # a file that was there keeps its mode otherwise
        f.write(text)


def env_file_text(values: Mapping[str, str]) -> str:
    """`docker run --env-file` lines: NAME=VALUE, the value verbatim."""
    return "".join(f"{k}={values[k]}\n" for k in sorted(values))


class SlurmJob:
    """The files of one job under ``run_dir/slurm``."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        config = unplaced(config, keep_router=not config.router.container)
        self.config = config
        self.run_dir = run_dir.resolve()
        self.dir = self.run_dir / "slurm"
        self.log_dir = self.run_dir / "logs"
        self.servers = servers(config)

    @property
    def batch(self) -> Path:
        return self.dir / "job.sbatch"

    @property
    def node(self) -> Path:
        return self.dir / "node.sh"

    @property
    def secrets_dir(self) -> Path:
        """Env files of the secret values (0600, in a 0700 directory),
        read by the engine on each node; removed when the job is over."""
        return self.dir / "secrets"

    def env_file(self, what: str, env: Mapping[str, str]) -> str:
        """The env file of ``what``'s secrets; "" when it has none."""
        if not secret_names(env):
            return ""
        return str(self.secrets_dir / f"{what}.env")

    def node_names(self) -> list[str]:
        return sorted(self.config.slurm.node_env)

    def addr(self, what: str) -> Path:
        return self.dir / "addr" / what

    def node_of(self, what: str) -> Path:
        """The Slurm node name ``what`` runs on (published before its
        address)."""
        return self.dir / "node" / what

    def exit_file(self, what: str) -> Path:
        return self.dir / "exit" / what

    def router_in_job(self) -> bool:
        return self.config.router.container

    def gpus_per_node(self) -> int:
        """`--gres=gpu:N`: the config's, or the largest server's TP x DP."""
        given = self.config.slurm.gpus_per_node
        return given if given is not None else max(s.gpus for s in self.servers)

    def batch_script(self) -> str:
        c, s = self.config, self.config.slurm
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name={run_name(c)}",
            f"#SBATCH --nodes={len(self.servers)}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --time={s.time}",
            *(f"#SBATCH --gres=gpu:{n}" for n in [self.gpus_per_node()] if n),
            *(["#SBATCH --exclusive"] if s.exclusive else []),
            f"#SBATCH --output={self.dir}/job-%j.out",
        ]
        if s.partition:
            lines.append(f"#SBATCH --partition={s.partition}")
        if s.account:
            lines.append(f"#SBATCH --account={s.account}")
        lines += [f"#SBATCH {opt}" for opt in s.sbatch_options]
        lines += [
            f"# Generated by `vllm-overlay e2e --launcher slurm` for {c.name}.",
            "# rank -> server (one task per node):",
            *(f"#   {i}: {srv.name}" for i, srv in enumerate(self.servers)),
            "set -euo pipefail",
            f"E2E_DIR={shlex.quote(str(self.dir))}",
            f"LOG_DIR={shlex.quote(str(self.log_dir))}",
            'mkdir -p "$E2E_DIR/addr" "$E2E_DIR/node" "$E2E_DIR/exit" "$LOG_DIR"',
        ]
        engine = shlex.quote(c.container.engine)
        if self.router_in_job():
            name = shlex.quote(container_name(c, "router"))
            run = docker_run_router(
                c, container_name(c, "router"), self.env_file("router", c.container.env)
            )
            lines += [
                "# The front end runs on this (the first) node; its address is",
                "# every server's proxy_ip.",
                *address_lines(c, "ROUTER_IP", front_end=True),
                '[ -n "$ROUTER_IP" ] || { echo "no address for the front end\'s node"; '
                "exit 1; }",
                "stop_router() {",
                f'  {engine} logs {name} > "$LOG_DIR/router.log" 2>&1 || true',
                f"  {engine} rm --force {name} >/dev/null 2>&1 || true",
                "}",
                "trap stop_router EXIT",
                "trap 'exit 143' TERM INT",
                *self.pull_lines('"$LOG_DIR/router.log"'),
                f"{engine} rm --force {name} >/dev/null 2>&1 || true",
                bash_line(run) + " >/dev/null",
                'echo "${SLURMD_NODENAME:-$(hostname -s)}" > "$E2E_DIR/node/router"',
                'echo "$ROUTER_IP" > "$E2E_DIR/addr/router.tmp"',
                'mv "$E2E_DIR/addr/router.tmp" "$E2E_DIR/addr/router"',
            ]
        else:
            lines.append(f"ROUTER_IP={shlex.quote(c.router.address or '')}")
        lines += [
            "export ROUTER_IP",
            # --overlap: the harness's job steps on these nodes (NIC
            # counters, the load phase) share them with this one.
            'srun --label --overlap --kill-on-bad-exit=0 bash "$E2E_DIR/node.sh"',
        ]
        return "\n".join(lines) + "\n"

    def pull_lines(self, log: str) -> list[str]:
        pull = pull_command(self.config)
        if pull is None:
            return []
        t = int(self.config.timeouts.pull_s)
        return [
            f"if ! timeout {t} {bash_line(pull)} >> {log} 2>&1; then",
            f'  echo "pull of the image failed or took over {t}s" >> {log}',
            "  exit 1",
            "fi",
        ]

    def cache_lines(self) -> list[str]:
        prepare = cache_command(self.config)
        if prepare is None:
            return []
        return [
            f'if ! {bash_line(prepare)} >> "$LOG" 2>&1; then',
            f'  echo "could not hand the cache directory to uid {IMAGE_UID}" >> "$LOG"',
            "  finish 1",
            "fi",
        ]

    def node_script(self) -> str:
        c, s = self.config, self.config.slurm
        engine = shlex.quote(c.container.engine)
        lines = [
            "#!/bin/bash",
            "# One task of the job: server number $SLURM_PROCID on this node.",
            "set -uo pipefail",
            f"E2E_DIR={shlex.quote(str(self.dir))}",
            f"LOG_DIR={shlex.quote(str(self.log_dir))}",
            'RANK="${SLURM_PROCID:?not a Slurm task}"',
            'ROUTER_IP="${ROUTER_IP:?}"',
            *address_lines(c, "HOST_IP", front_end=False),
            'case "$RANK" in',
        ]
        for i, srv in enumerate(self.servers):
            lines.append(f"  {i}) WHAT={srv.name} ;;")
        lines += [
            '  *) echo "rank $RANK: no server" >&2; exit 1 ;;',
            "esac",
            "NODE_ENV=()",
            'NODE="${SLURMD_NODENAME:-$(hostname -s)}"',
            'case "$NODE" in',
        ]
        for i, node in enumerate(self.node_names()):
            env = s.node_env[node]
            flags = [
                f
                for k in sorted(env)
                if not is_secret(k)
                for f in ("--env", f"{k}={env[k]}")
            ]
            env_file = self.env_file(f"node-{i}", env)
            if env_file:
                flags += ["--env-file", env_file]
            lines.append(f"  {shlex.quote(node)}) NODE_ENV=({bash_line(flags)}) ;;")
        lines += [
            "esac",
            'LOG="$LOG_DIR/$WHAT.log"',
            f'NAME="{run_name(c)}-$WHAT"',
            'finish() { echo "$1" > "$E2E_DIR/exit/$WHAT"; exit "$1"; }',
            '[ -n "$HOST_IP" ] || { echo "no address for node $NODE" >> "$LOG"; '
            "finish 1; }",
            'echo "$NODE" > "$E2E_DIR/node/$WHAT"',
            'echo "$HOST_IP" > "$E2E_DIR/addr/$WHAT.tmp"',
            'mv "$E2E_DIR/addr/$WHAT.tmp" "$E2E_DIR/addr/$WHAT"',
            *(
                [
                    "# The node's render group id (--group-add takes it by number).",
                    RENDER_GID_SH.replace(">&2;", '>> "$LOG";'),
                ]
                if RENDER_GID in c.container.run_flags + c.container.extra_run_flags
                else []
            ),
            *[line.replace("exit 1", "finish 1") for line in self.pull_lines('"$LOG"')],
            *self.cache_lines(),
            f'{engine} rm --force "$NAME" >/dev/null 2>&1 || true',
            f"trap '{engine} rm --force \"$NAME\" >/dev/null 2>&1; exit 143' TERM INT",
            'case "$RANK" in',
        ]
        for i, srv in enumerate(self.servers):
            name = container_name(self.config, srv.name)
            run = docker_run_server(
                self.config, srv, name, detach=False,
                env_file=self.env_file(srv.name, srv.env),
            )  # fmt: skip
            at = run.index("--entrypoint")
            run = [*run[:at], NODE_ENV, *run[at:]]
            lines.append(f'  {i}) {bash_line(run)} >> "$LOG" 2>&1 & ;;')
        lines += [
            "esac",
            'wait "$!"',
            'finish "$?"',
        ]
        return "\n".join(lines) + "\n"

    def write(
        self,
        secrets: Mapping[str, Mapping[str, str]] | None = None,
        nodes: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        """The scripts, and the env files of the secret values: ``secrets``
        per container (`leg_secrets`), ``nodes`` per node (`node_secrets`);
        default: the config's, or the harness's environment for an empty one."""
        for d in (
            self.dir / "addr",
            self.dir / "node",
            self.dir / "exit",
            self.log_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)
        self.batch.write_text(self.batch_script())
        self.node.write_text(self.node_script())
        self.node.chmod(0o755)
        secrets = leg_secrets(self.config) if secrets is None else secrets
        nodes = node_secrets(self.config) if nodes is None else nodes
        files = {
            what: env
            for what, env in secrets.items()
            if env and (what != "router" or self.router_in_job())
        }
        for i, node in enumerate(self.node_names()):
            if nodes.get(node):
                files[f"node-{i}"] = nodes[node]
        if not files:
            return
        self.secrets_dir.mkdir(mode=0o700, exist_ok=True)
        self.secrets_dir.chmod(0o700)
        for what, env in files.items():
            write_private(self.secrets_dir / f"{what}.env", env_file_text(env))

    def remove_secrets(self) -> None:
        shutil.rmtree(self.secrets_dir, ignore_errors=True)


def secret_lines(job: SlurmJob) -> list[str]:
    """Which secrets each container's env file holds, masked."""
    c = job.config
    envs = {s.name: s.env for s in job.servers}
    if job.router_in_job():
        envs = {"router": c.container.env, **envs}
    envs.update(
        {f"node-{i}": c.slurm.node_env[n] for i, n in enumerate(job.node_names())}
    )
    held = {w: secret_names(env) for w, env in envs.items() if secret_names(env)}
    if not held:
        return []
    return [
        f"# secrets, written to {job.secrets_dir}/<what>.env (0600) when the job is "
        "submitted and removed when it is over; the scripts name the files only:",
        *(
            f"#   {w}.env: {', '.join(f'{n}={MASK}' for n in names)}"
            for w, names in held.items()
        ),
    ]


def dry_run_lines(job: SlurmJob) -> list[str]:
    return [
        *secret_lines(job),
        f"# sbatch {job.batch}",
        *job.batch_script().splitlines(),
        f"# {job.node} (every task)",
        *job.node_script().splitlines(),
    ]


class SlurmLauncher(ClosedOnExit):
    """Submit the job, wait for every server, watch the job; on leaving the
    ``with`` block, cancel the job and wait until it has left the queue."""

    closing = "cancelling the job"

    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = SlurmJob(config, run_dir)
        self.config = self.job.config
        self.log_dir = self.job.log_dir
        self.say = say
        self.clock = clock
        self.job_id = ""
        # sbatch was started: an interruption before its answer may leave a
        # job whose id the harness never read (cancelled by its name).
        self.submitted = False
        self.router_proc: subprocess.Popen[bytes] | None = None
        self.stopped: list[ContainerState] = []
        self.endpoints: Endpoints | None = None
        # The Slurm node each server (and the in-job front end) runs on.
        self.nodes: dict[str, str] = {}
        self._closed = False

    def __enter__(self) -> SlurmLauncher:
        return self

    def command(self, argv: list[str]) -> str:
        t = self.config.timeouts.command_s
        result = run_command(argv, t)
        if result.returncode != 0:
            err = (result.stderr or result.stdout).decode(errors="replace").strip()
            raise LaunchError(f"{argv[0]}: exit {result.returncode}: {err[-400:]}")
        return result.stdout.decode(errors="replace").strip()

    def setup(self) -> Endpoints:
        self.job.write()
        r = self.config.router
        if not r.container:
            argv = router_command(self.config, place="harness")
            argv = [resolve_executable(argv[0]), *argv[1:]]
            self.say(f"[router @ local] {shlex.join(argv)}  (background process)")
            log = (self.log_dir / "router.log").open("wb")
            try:
                self.router_proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            except OSError as e:
                raise LaunchError(f"{argv[0]}: cannot run: {e}") from None
            finally:
                log.close()
        self.submitted = True
        out = self.command(["sbatch", "--parsable", str(self.job.batch)])
        self.job_id = out.split(";")[0].strip()
        if not self.job_id.isdigit():
            raise LaunchError(f"sbatch: no job id in {out!r}")
        self.say(
            f"[slurm] submitted job {self.job_id}: {len(self.job.servers)} nodes, "
            + ", ".join(f"rank {i} {s.name}" for i, s in enumerate(self.job.servers))
        )
        addresses = self.wait_addresses()
        ends = self.resolve(addresses)
        t = self.config.timeouts
        urls = [f"{u}/health" for u in [*ends.prefill, *ends.decode]]
        for srv, url in zip(self.job.servers, urls, strict=True):
            self.say(f"[{srv.name} @ {addresses[srv.name]}] wait for GET {url}")
        # Every server at once: they load their weights side by side.
        wait_all_healthy(
            [(u, probe) for u in urls], t.health_s, t.poll_s, alive=self.check_alive
        )
        if r.kind == "vllm-router":
            self.say(f"[router] wait for GET {ends.front}/health")
            wait_healthy(
                f"{ends.front}/health", t.health_s, t.poll_s, alive=self.check_alive
            )
        else:
            front = ends.front.removeprefix("http://")
            self.say(f"[router] wait for {front} to accept connections")
            wait_healthy(
                front, t.health_s, t.poll_s, alive=self.check_alive, check=probe_tcp
            )
        self.endpoints = ends
        return ends

    def wait_addresses(self) -> dict[str, str]:
        """Every server's (and the in-job front end's) published address."""
        names = [s.name for s in self.job.servers]
        if self.job.router_in_job():
            names.append("router")
        t = self.config.timeouts
        deadline = self.clock() + t.health_s
        while True:
            found = {
                n: self.job.addr(n).read_text().strip()
                for n in names
                if self.job.addr(n).is_file()
            }
            if len(found) == len(names) and all(found.values()):
                self.nodes = {
                    n: self.job.node_of(n).read_text().strip()
                    for n in names
                    if self.job.node_of(n).is_file()
                }
                for n in names:
                    on = f" on node {self.nodes[n]}" if self.nodes.get(n) else ""
                    self.say(f"[slurm] {n} runs at {found[n]}{on}")
                return found
            self.check_alive()
            if self.clock() >= deadline:
                missing = sorted(set(names) - set(found))
                raise HealthTimeout(
                    f"slurm job {self.job_id}: no address from {', '.join(missing)} "
                    f"after {t.health_s:g}s"
                )
            time.sleep(min(t.poll_s, 1.0))

    def resolve(self, addresses: dict[str, str]) -> Endpoints:
        def url(s: Server) -> str:
            host = addresses[s.name] if s.address == HOST_IP else s.address
            return f"http://{host}:{s.http_port}"

        r = self.config.router
        front_host = addresses.get("router") or r.address or ""
        pre = [url(s) for s in self.job.servers if s.role == "prefill"]
        dec = [url(s) for s in self.job.servers if s.role == "decode"]
        return Endpoints(f"http://{front_host}:{r.port}", pre[0], pre, dec)

    def on_node(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``node`` as a step of the job, beside its servers."""
        return [
            "srun", f"--jobid={self.job_id}", "--overlap", "--nodes=1",
            "--ntasks=1", f"--nodelist={node}", "--input=none", "--quiet",
            *argv,
        ]  # fmt: skip

    def place(self, node: str) -> Place:
        return lambda argv: self.on_node(node, argv)

    def nic_nodes(self) -> dict[str, tuple[Place, list[str]]]:
        """Every decode server's node, reached by a job step, with its RDMA
        devices: its node's `slurm.node_env` MORI_RDMA_DEVICES (the node
        script passes those after the server's own), else the server's."""
        out: dict[str, tuple[Place, list[str]]] = {}
        for s in self.job.servers:
            node = self.nodes.get(s.name, "")
            if s.role != "decode" or not node:
                continue
            devices = devices_of(self.config.slurm.node_env.get(node, {}))
            devices = devices or devices_of(s.env)
            known = out.get(node, (self.place(node), []))[1]
            out[node] = (self.place(node), sorted({*known, *devices}))
        return out

    def bench_host(self) -> BenchHost | None:
        """Where the load phase's bench runs: a job step on the front end's
        node, its secrets from the front end's env file; None: the front
        end runs on the harness node (the bench too, as over ssh)."""
        node = self.nodes.get("router", "")
        if not self.job.router_in_job() or not node:
            return None
        env_file = self.job.env_file("router", self.config.container.env)
        return BenchHost(f"slurm node {node}", self.place(node), env_file)

    def job_state(self) -> str:
        out = self.command(
            ["squeue", "--noheader", "--jobs", self.job_id, "--format", "%T"]
        )
        return out.splitlines()[0].strip() if out else ""

    def check_alive(self) -> None:
        """Raise ContainerExited if a task's server stopped or the job ended."""
        for s in self.job.servers:
            f = self.job.exit_file(s.name)
            if f.is_file():
                code = f.read_text().strip()
                state = ContainerState(
                    s.name, f"slurm job {self.job_id}", "exited",
                    int(code) if code.lstrip("-").isdigit() else -1, False,
                    self.log_tail(self.log_dir / f"{s.name}.log"),
                )  # fmt: skip
                self.stopped.append(state)
                raise ContainerExited(self.stop_message(state))
        if self.router_proc is not None and self.router_proc.poll() is not None:
            state = ContainerState(
                "router", "local", "process", self.router_proc.returncode, False,
                self.log_tail(self.log_dir / "router.log"),
            )  # fmt: skip
            self.stopped.append(state)
            raise ContainerExited(self.stop_message(state))
        state_name = self.job_state()
        if state_name not in QUEUE_STATES:
            out = next(iter(sorted(self.job.dir.glob(f"job-{self.job_id}.out"))), None)
            state = ContainerState(
                "job", f"slurm job {self.job_id}", state_name or "gone", -1, False,
                self.log_tail(out) if out else [],
            )  # fmt: skip
            self.stopped.append(state)
            raise ContainerExited(self.stop_message(state))

    @staticmethod
    def log_tail(path: Path) -> list[str]:
        if not path.is_file():
            return []
        return last_lines(path.read_text(errors="replace"))

    @staticmethod
    def stop_message(state: ContainerState) -> str:
        tail = " | ".join(state.last_lines[-3:]) or "no log output"
        return f"{state.describe()}; last lines: {tail[:600]}"

    def close(self) -> None:
        """Cancel the job and wait until it left the queue; never raises."""
        if self._closed:
            return
        self._closed = True
        if self.job_id:
            self.say(f"[slurm] scancel {self.job_id}")
            try:
                self.command(["scancel", self.job_id])
                deadline = self.clock() + self.config.slurm.cancel_s
                while self.job_state() and self.clock() < deadline:
                    time.sleep(1.0)
                if self.job_state():
                    self.say(f"e2e: job {self.job_id} still queued after scancel")
            except LaunchError as e:
                self.say(f"e2e: cancelling job {self.job_id} failed: {e}")
        elif self.submitted:
            # Interrupted while sbatch ran: the job, if any, is this run's
            # by its name (the run id) and this user.
            name = run_name(self.config)
            self.say(f"[slurm] scancel --name {name} --user {owner()}")
            try:
                self.command(["scancel", "--name", name, "--user", owner()])
            except LaunchError as e:
                self.say(f"e2e: cancelling job {name} failed: {e}")
        self.job.remove_secrets()
        if self.router_proc is not None and self.router_proc.poll() is None:
            self.router_proc.terminate()
            try:
                self.router_proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.router_proc.kill()
                self.router_proc.wait(timeout=STOP_GRACE_S)
