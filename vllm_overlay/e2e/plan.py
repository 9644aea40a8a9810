"""The ordered commands of a run, per host: what `--dry-run` prints."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from typing import Literal

import msgspec

from vllm_overlay.e2e.config import MoRIIO, PairConfig, Reach, Server

Role = Literal["router", "prefill", "decode"]
# clean/start/collect/stop run a command on a host; spawn starts a process of
# the harness node that stop terminates; wait polls a URL from the harness.
Action = Literal["clean", "start", "spawn", "wait", "collect", "stop"]

# What MoRIIO needs from the container on ROCm: the host's network and IPC
# namespaces, the GPU (kfd, dri) and RDMA (infiniband) devices, unlimited
# locked memory for registered KV buffers.
ROCM_FLAGS = (
    "--network", "host", "--ipc", "host", "--privileged",
    "--device", "/dev/kfd", "--device", "/dev/dri", "--device", "/dev/infiniband",
    "--ulimit", "memlock=-1",
)  # fmt: skip


class Step(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    action: Action
    where: str  # "local" or the ssh destination
    argv: list[str]  # what runs on the harness node (ssh-wrapped when remote)
    # For `start`: the command inside the container (vllm serve / vllm-router).
    inner: list[str] = msgspec.field(default_factory=list)
    container: str = ""
    url: str = ""  # for `wait`
    timeout_s: float = 0.0
    must_succeed: bool = True

    def describe(self) -> str:
        if self.action == "wait":
            return f"wait for GET {self.url} -> 200 (timeout {self.timeout_s:g}s)"
        if self.action == "spawn":
            return f"{shlex.join(self.argv)}  (background process)"
        if self.action == "stop" and not self.argv:
            return f"terminate the {self.role} process"
        return shlex.join(self.argv)


class Plan(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    image: str
    setup: list[Step]  # clean, start, wait: in order
    collect: list[Step]  # container logs, before stop
    teardown: list[Step]  # stop, reverse start order

    @property
    def steps(self) -> list[Step]:
        return [*self.setup, *self.collect, *self.teardown]

    def only(self, roles: set[Role]) -> Plan:
        """The plan restricted to some roles (e.g. the router alone)."""

        def keep(steps: list[Step]) -> list[Step]:
            return [s for s in steps if s.role in roles]

        return Plan(
            self.name, self.image, keep(self.setup), keep(self.collect),
            keep(self.teardown),
        )  # fmt: skip


def on_host(reach: Reach, argv: list[str]) -> list[str]:
    """``argv`` as run from the harness node on a host reached by ``reach``."""
    if not reach.ssh:
        return list(argv)
    return ["ssh", *reach.ssh_options, reach.ssh, shlex.join(argv)]


def where(reach: Reach) -> str:
    return reach.ssh or "local"


def container_name(config: PairConfig, role: Role) -> str:
    return f"{config.container.name_prefix}-{config.name}-{role}"


def kv_transfer_config(config: PairConfig, server: Server, role: Role) -> str:
    """The `--kv-transfer-config` JSON for one leg (MoRIIO READ)."""
    m: MoRIIO = config.moriio
    extra: dict[str, object] = {
        "proxy_ip": config.router.address,
        "proxy_ping_port": config.router.proxy_ping_port,
        "http_port": server.http_port,
        "handshake_port": server.handshake_port,
        "notify_port": server.notify_port,
        "host_ip": server.address,
        "read_mode": m.read_mode,
        "backend": m.backend,
    }
    optional = {
        "qp_per_transfer": m.qp_per_transfer,
        "post_batch_size": m.post_batch_size,
        "num_workers": m.num_workers,
        "transfer_timeout": m.transfer_timeout,
        "defer_timeout": m.defer_timeout,
    }
    extra.update({k: v for k, v in optional.items() if v is not None})
    kv = {
        "kv_connector": "MoRIIOConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": extra,
    }
    return json.dumps(kv, separators=(",", ":"))


def serve_command(config: PairConfig, role: Literal["prefill", "decode"]) -> list[str]:
    """`vllm serve ...` for one leg, as run inside the container."""
    server = config.prefill if role == "prefill" else config.decode
    model = config.model
    argv = [
        "vllm", "serve", model.path,
        "--host", "0.0.0.0",
        "--port", str(server.http_port),
        "--served-model-name", model.served_name,
        "--tensor-parallel-size", str(server.tp),
    ]  # fmt: skip
    if server.dcp > 1:
        argv += ["--decode-context-parallel-size", str(server.dcp)]
    argv += [
        "--block-size", str(model.block_size),
        "--max-model-len", str(model.max_model_len),
        "--kv-transfer-config", kv_transfer_config(config, server, role),
        *model.extra_args,
        *server.extra_args,
    ]  # fmt: skip
    return argv


def router_command(config: PairConfig) -> list[str]:
    """`vllm-router` in P/D mode with MoRIIO service discovery."""
    r = config.router
    return [
        "vllm-router",
        "--host", r.bind,
        "--port", str(r.port),
        "--vllm-pd-disaggregation",
        "--kv-connector", "moriio",
        "--vllm-discovery-address", f"{r.bind}:{r.proxy_ping_port}",
        "--policy", r.policy,
        "--prometheus-host", r.bind,
        "--prometheus-port", str(r.prometheus_port),
        *r.extra_args,
    ]  # fmt: skip


def docker_run(config: PairConfig, role: Role, inner: list[str]) -> list[str]:
    c = config.container
    argv = [c.engine, "run", "--detach", "--name", container_name(config, role)]
    env = dict(c.env)
    if role == "router":
        argv += ["--network", "host"]
    else:
        argv += [*ROCM_FLAGS, "--shm-size", c.shm_size]
        for volume in c.volumes:
            argv += ["--volume", volume]
        server = config.prefill if role == "prefill" else config.decode
        if server.visible_devices:
            env["HIP_VISIBLE_DEVICES"] = server.visible_devices
    for key in sorted(env):
        argv += ["--env", f"{key}={env[key]}"]
    argv += ["--entrypoint", inner[0], c.image, *inner[1:]]
    return argv


def build_plan(config: PairConfig) -> Plan:
    c = config.container
    legs: list[tuple[Role, Reach, list[str], str]] = [
        (
            "router",
            config.router.reach,
            router_command(config),
            f"http://{config.router.address}:{config.router.port}/health",
        ),
        (
            "prefill",
            config.prefill.reach,
            serve_command(config, "prefill"),
            f"http://{config.prefill.address}:{config.prefill.http_port}/health",
        ),
        (
            "decode",
            config.decode.reach,
            serve_command(config, "decode"),
            f"http://{config.decode.address}:{config.decode.http_port}/health",
        ),
    ]
    contained = [leg for leg in legs if leg[0] != "router" or config.router.container]
    setup: list[Step] = []
    for role, reach, _, _ in contained:
        rm = [c.engine, "rm", "--force", container_name(config, role)]
        setup.append(
            Step(role, "clean", where(reach), on_host(reach, rm), must_succeed=False)
        )
    for role, reach, inner, _ in legs:
        if role == "router" and not config.router.container:
            setup.append(Step(role, "spawn", "local", inner, inner))
            continue
        name = container_name(config, role)
        argv = on_host(reach, docker_run(config, role, inner))
        setup.append(Step(role, "start", where(reach), argv, inner, name))
    # The servers first; the router's /health turns 200 only once both have
    # registered through their MoRIIO heartbeats.
    for role, _, _, url in [*legs[1:], legs[0]]:
        setup.append(
            Step(
                role, "wait", "harness", [], url=url, timeout_s=config.timeouts.health_s
            )
        )
    collect = [
        Step(
            role,
            "collect",
            where(reach),
            on_host(reach, [c.engine, "logs", container_name(config, role)]),
            container=container_name(config, role),
            must_succeed=False,
        )
        for role, reach, _, _ in contained
    ]
    teardown = [
        Step(
            role,
            "stop",
            where(reach),
            on_host(reach, [c.engine, "rm", "--force", container_name(config, role)]),
            container=container_name(config, role),
            must_succeed=False,
        )
        for role, reach, _, _ in reversed(contained)
    ]
    if not config.router.container:
        teardown.append(Step("router", "stop", "local", [], must_succeed=False))
    return Plan(config.name, c.image, setup, collect, teardown)


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
            lines.append(f"{n:2d}. [{step.role} @ {step.where}] {step.describe()}")
    return "\n".join(lines) + "\n"
