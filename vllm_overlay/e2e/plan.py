"""The ordered commands of a run started over ssh (or on this node): what
`--dry-run` prints and what `launch.Launcher` executes."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Literal

import msgspec

from vllm_overlay.e2e.config import CACHE_MOUNT, IMAGE_UID, RENDER_GID, Reach, RunConfig
from vllm_overlay.e2e.secret import MASK, secret_names
from vllm_overlay.e2e.servers import (
    RENDER_GID_SH,
    container_name,
    docker_run_router,
    docker_run_server,
    router_command,
    servers,
)

# clean/pull/prepare/start/collect/stop run a command on a host; spawn starts a
# process of the harness node that stop terminates; wait polls an endpoint
# from the harness.
Action = Literal[
    "clean", "pull", "prepare", "start", "spawn", "wait", "collect", "stop"
]
Probe = Literal["http", "tcp"]


class Step(msgspec.Struct, forbid_unknown_fields=True):
    what: str  # "router", "prefill-0", ... or "node" for a pull
    action: Action
    where: str  # "local", the ssh destination, or "harness"
    argv: list[str]  # what runs on the harness node (ssh-wrapped when remote)
    reach: Reach = msgspec.field(default_factory=Reach)
    container: str = ""
    url: str = ""  # for `wait`
    probe: Probe = "http"
    timeout_s: float = 0.0
    must_succeed: bool = True
    # Secret env names the command reads from its stdin, one value a line
    # (`with_secrets`); the launcher writes them there. Never their values.
    secret_env: list[str] = msgspec.field(default_factory=list)

    def describe(self) -> str:
        if self.action == "wait":
            if self.probe == "tcp":
                return f"wait for {self.url} to accept connections"
            return f"wait for GET {self.url} -> 200 (timeout {self.timeout_s:g}s)"
        if self.action == "spawn":
            return f"{shlex.join(self.argv)}  (background process)"
        if self.action == "stop" and not self.argv:
            return f"terminate the {self.what} process"
        if self.action == "pull":
            return f"{shlex.join(self.argv)}  (timeout {self.timeout_s:g}s)"
        if self.secret_env:
            given = ", ".join(f"{n}={MASK}" for n in self.secret_env)
            return f"{shlex.join(self.argv)}  (on stdin: {given})"
        return shlex.join(self.argv)


class Plan(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    image: str
    engine: str
    setup: list[Step]  # clean, pull, start, wait: in order
    collect: list[Step]  # container logs, before stop
    teardown: list[Step]  # stop, reverse start order

    @property
    def steps(self) -> list[Step]:
        return [*self.setup, *self.collect, *self.teardown]

    def attach(self) -> Plan:
        """Only the health waits: the checks against servers started by
        someone else (Kubernetes, by hand); nothing is started or removed."""
        waits = [s for s in self.setup if s.action == "wait"]
        return Plan(self.name, self.image, self.engine, waits, [], [])

    def only(self, what: set[str]) -> Plan:
        """The plan restricted to some parts (e.g. the router alone)."""

        def keep(steps: list[Step]) -> list[Step]:
            return [s for s in steps if s.what in what]

        return Plan(
            self.name, self.image, self.engine, keep(self.setup),
            keep(self.collect), keep(self.teardown),
        )  # fmt: skip


def on_host(reach: Reach, argv: list[str]) -> list[str]:
    """``argv`` as run from the harness node on a host reached by ``reach``."""
    if not reach.ssh:
        return list(argv)
    return ["ssh", *reach.ssh_options, reach.ssh, shlex.join(argv)]


def with_secrets(argv: list[str], names: list[str]) -> list[str]:
    """``argv`` run by sh once it has read the values of ``names`` from
    its stdin, one a line, into its environment: the values reach the
    engine (`--env NAME`) through ssh's stdin, never a command line."""
    if not names:
        return list(argv)
    reads = " && ".join(f"IFS= read -r {n}" for n in names)
    script = f'{reads} && export {" ".join(names)} && exec "$@"'
    return ["sh", "-c", script, "sh", *argv]


def with_render_gid(argv: list[str]) -> list[str]:
    """``argv`` with its RENDER_GID placeholder replaced, on the node, by
    the node's render group id (`RENDER_GID_SH`); unchanged without one."""
    if RENDER_GID not in argv:
        return list(argv)
    swap = (
        'for a do shift; if [ "$a" = ' + RENDER_GID + ' ]; then set -- "$@" '
        '"$RENDER_GID"; else set -- "$@" "$a"; fi; done; exec "$@"'
    )
    return ["sh", "-c", f"{RENDER_GID_SH}; {swap}", "sh", *argv]


def where(reach: Reach) -> str:
    return reach.ssh or "local"


def pull_command(config: RunConfig) -> list[str] | None:
    """The image pull of one node, by policy; None: never pull."""
    c = config.container
    image = shlex.quote(c.image)
    engine = shlex.quote(c.engine)
    if c.pull == "never":
        return None
    if c.pull == "always":
        return [c.engine, "pull", c.image]
    script = f"{engine} image inspect {image} >/dev/null 2>&1 || {engine} pull {image}"
    return ["sh", "-c", script]


def cache_command(config: RunConfig) -> list[str] | None:
    """The cache directory of a node handed to the image's user (vLLM runs
    as uid IMAGE_UID; docker creates a missing directory as root), from a
    throwaway root container of the image; None: no cache directory."""
    c = config.container
    if not c.cache_dir:
        return None
    owner = f"{IMAGE_UID}:{IMAGE_UID}"
    return [
        c.engine, "run", "--rm", "--user", "0", "--entrypoint", "chown",
        "--volume", f"{c.cache_dir}:{CACHE_MOUNT}", c.image, "-R", owner, CACHE_MOUNT,
    ]  # fmt: skip


def build_plan(config: RunConfig) -> Plan:
    """Every command of a run, in order; needs every address."""
    config.check_addresses()
    c = config.container
    r = config.router
    router_url = f"http://{r.address}:{r.port}"
    legs: list[tuple[str, Reach, list[str] | None, str]] = []
    # (what, reach, docker run argv or None for a harness process, url)
    env_of: dict[str, dict[str, str]] = {"router": c.env}
    if r.container:
        name = container_name(config, "router")
        legs.append(("router", r.reach, docker_run_router(config, name), router_url))
    for s in servers(config):
        name = container_name(config, s.name)
        legs.append((s.name, s.reach, docker_run_server(config, s, name), s.url))
        env_of[s.name] = s.env

    setup: list[Step] = []
    for what, reach, _, _ in legs:
        rm = [c.engine, "rm", "--force", container_name(config, what)]
        setup.append(
            Step(
                what, "clean", where(reach), on_host(reach, rm), reach,
                container_name(config, what), must_succeed=False,
            )
        )  # fmt: skip
    pull = pull_command(config)
    if pull is not None:
        hosts: dict[str, Reach] = {}
        for _, reach, _, _ in legs:
            hosts.setdefault(where(reach), reach)
        for host, reach in hosts.items():
            setup.append(
                Step(
                    "node", "pull", host, on_host(reach, pull), reach,
                    timeout_s=config.timeouts.pull_s,
                )
            )  # fmt: skip
    prepare = cache_command(config)
    if prepare is not None:
        nodes: dict[str, Reach] = {}
        for s in servers(config):
            nodes.setdefault(where(s.reach), s.reach)
        for host, reach in nodes.items():
            setup.append(Step("node", "prepare", host, on_host(reach, prepare), reach))
    if not r.container:
        argv = router_command(config, place="harness")
        setup.append(Step("router", "spawn", "local", argv))
    for what, reach, run_argv, _ in legs:
        assert run_argv is not None
        names = secret_names(env_of[what])
        setup.append(
            Step(
                what, "start", where(reach),
                on_host(reach, with_secrets(with_render_gid(run_argv), names)),
                reach,
                container_name(config, what), secret_env=names,
            )
        )  # fmt: skip
    # The servers first: the front end serves only once they registered.
    for s in servers(config):
        setup.append(
            Step(
                s.name, "wait", "harness", [], url=f"{s.url}/health",
                timeout_s=config.timeouts.health_s,
            )
        )  # fmt: skip
    if r.kind == "vllm-router":
        setup.append(
            Step(
                "router", "wait", "harness", [], url=f"{router_url}/health",
                timeout_s=config.timeouts.health_s,
            )
        )  # fmt: skip
    else:
        # The toy proxy has no /health: wait for its port; the harness's
        # first request (the max_tokens probe) then waits for registration.
        setup.append(
            Step(
                "router", "wait", "harness", [], url=f"{r.address}:{r.port}",
                probe="tcp", timeout_s=config.timeouts.health_s,
            )
        )  # fmt: skip
    collect = [
        Step(
            what, "collect", where(reach),
            on_host(reach, [c.engine, "logs", container_name(config, what)]),
            reach, container_name(config, what), must_succeed=False,
        )
        for what, reach, _, _ in legs
    ]  # fmt: skip
    teardown = [
        Step(
            what, "stop", where(reach),
            on_host(reach, [c.engine, "rm", "--force", container_name(config, what)]),
            reach, container_name(config, what), must_succeed=False,
        )
        for what, reach, _, _ in reversed(legs)
    ]  # fmt: skip
    if not r.container:
        teardown.append(Step("router", "stop", "local", [], must_succeed=False))
    return Plan(config.name, c.image, c.engine, setup, collect, teardown)


def format_plan(plan: Plan, checks: Sequence[str] = ()) -> str:
    """Every command with its host, in order: the dry run. ``checks`` are
    lines describing what the harness sends once everything is healthy."""
    lines = [f"# e2e plan {plan.name}: image {plan.image}"]
    n = 0
    for title, steps in (
        ("setup", plan.setup),
        ("checks", None),
        ("collect logs", plan.collect),
        ("teardown (also on failure and Ctrl-C)", plan.teardown),
    ):
        lines.append(f"## {title}")
        if steps is None:
            lines += [f"- {line}" for line in checks]
            continue
        for step in steps:
            n += 1
            lines.append(f"{n:2d}. [{step.what} @ {step.where}] {step.describe()}")
    lines.append(
        f"(liveness: every poll runs `{plan.engine} inspect` on each started "
        "container; one that exited stops the run with its exit code and last "
        "log lines)"
    )
    return "\n".join(lines) + "\n"
