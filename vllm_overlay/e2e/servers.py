"""Every server of a run and the commands that start it and the front end.

A `Server` is one vLLM instance of one side with its per-node settings
resolved. Its address may be a placeholder (`HOST_IP`) that the Slurm
launcher fills in on the node; the commands carry placeholders through
unchanged (`ROUTER_IP` stands for the front end's address).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Literal

import msgspec

from vllm_overlay.e2e.config import (
    CACHE_ENV,
    CACHE_MOUNT,
    ENGINE_READY_TIMEOUT_S,
    RENDER_GID,
    ROLES,
    Reach,
    Role,
    RunConfig,
    Side,
)
from vllm_overlay.e2e.runid import label_flags, run_name
from vllm_overlay.e2e.secret import SecretError, is_secret, secret_names

# Filled in on the node by the Slurm launcher.
HOST_IP = "@HOST_IP@"
ROUTER_IP = "@ROUTER_IP@"
PLACEHOLDERS = {HOST_IP: "HOST_IP", ROUTER_IP: "ROUTER_IP", RENDER_GID: "RENDER_GID"}
# Sets RENDER_GID on the node: the group owning its GPU render nodes, else
# its `render` group's id; a node with neither (no GPU) says so and keeps
# the name.
RENDER_GID_SH = (
    "RENDER_GID=$(stat -c %g /dev/dri/renderD* 2>/dev/null | head -n 1); "
    '[ -n "$RENDER_GID" ] || RENDER_GID=$(getent group render | cut -d: -f3); '
    '[ -n "$RENDER_GID" ] || { echo "$(hostname): no /dev/dri/renderD* and no '
    'render group: --group-add render by name" >&2; RENDER_GID=render; }'
)

# The front end's process inside a container, or on the harness node.
FrontEndPlace = Literal["container", "harness"]


class Server(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    index: int
    address: str  # an address, or HOST_IP
    reach: Reach
    http_port: int
    handshake_port: int
    notify_port: int
    env: dict[str, str]
    tp: int
    dp: int
    dcp: int

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.http_port}"

    @property
    def gpus(self) -> int:
        return self.tp * self.dp


def server_env(
    config: RunConfig, side: Side, inst_env: dict[str, str], devices: str
) -> dict[str, str]:
    """The container env of one server, later entries winning: the
    harness's defaults, the cache, the config's container, side and
    instance env, then the GPUs."""
    env = {"VLLM_ENGINE_READY_TIMEOUT_S": str(ENGINE_READY_TIMEOUT_S)}
    if config.container.cache_dir:
        env.update(CACHE_ENV)
    env.update(config.container.env)
    env.update(side.env)
    env.update(inst_env)
    if devices:
        env["HIP_VISIBLE_DEVICES"] = devices
    return env


def servers(config: RunConfig, role: Role | None = None) -> list[Server]:
    """Every server of ``role`` (default: prefill then decode), in rank order."""
    out: list[Server] = []
    for r in ROLES if role is None else (role,):
        side = config.side(r)
        for i, inst in enumerate(side.instances):
            devices = (
                inst.visible_devices
                if inst.visible_devices is not None
                else side.visible_devices
            )
            out.append(
                Server(
                    role=r,
                    index=i,
                    address=inst.address or HOST_IP,
                    reach=inst.reach or Reach(),
                    http_port=inst.http_port or side.http_port,
                    handshake_port=inst.handshake_port or side.handshake_port,
                    notify_port=inst.notify_port or side.notify_port,
                    env=server_env(config, side, inst.env, devices),
                    tp=side.tp,
                    dp=side.dp,
                    dcp=side.dcp,
                )
            )
    return out


def unplaced(config: RunConfig, keep_router: bool = False) -> RunConfig:
    """The config with every server's address (and the front end's, unless
    ``keep_router``) left to where a scheduler places them: the commands
    then carry HOST_IP and ROUTER_IP."""
    sides = {
        role: msgspec.structs.replace(
            config.side(role),
            instances=[
                msgspec.structs.replace(i, address=None)
                for i in config.side(role).instances
            ],
        )
        for role in ROLES
    }
    router = config.router
    if not keep_router:
        router = msgspec.structs.replace(router, address=None)
    return msgspec.structs.replace(config, router=router, **sides)


def router_address(config: RunConfig) -> str:
    return config.router.address or ROUTER_IP


def kv_transfer_config(config: RunConfig, server: Server) -> str:
    """The `--kv-transfer-config` JSON of one server (MoRIIO in the
    configured mode, named explicitly)."""
    m = config.moriio
    extra: dict[str, object] = {
        "proxy_ip": router_address(config),
        "proxy_ping_port": config.router.proxy_ping_port,
        "http_port": server.http_port,
        "handshake_port": server.handshake_port,
        "notify_port": server.notify_port,
        "host_ip": server.address,
        "read_mode": m.mode == "read",
        "backend": m.backend,
    }
    optional = {
        "qp_per_transfer": m.qp_per_transfer,
        "post_batch_size": m.post_batch_size,
        "num_workers": m.num_workers,
        "transfer_timeout": m.transfer_timeout,
        "defer_timeout": m.defer_timeout,
        "recv_abort_timeout": m.recv_abort_timeout,
        "write_recv_timeout": m.write_recv_timeout,
        "write_quarantine_timeout": m.write_quarantine_timeout,
    }
    extra.update({k: v for k, v in optional.items() if v is not None})
    kv = {
        "kv_connector": "MoRIIOConnector",
        "kv_role": "kv_producer" if server.role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": extra,
    }
    return json.dumps(kv, separators=(",", ":"))


def serve_command(config: RunConfig, server: Server) -> list[str]:
    """`vllm serve ...` for one server, as run inside its container."""
    side = config.side(server.role)
    model = config.model
    argv = [
        "vllm", "serve", model.path,
        "--host", "0.0.0.0",
        "--port", str(server.http_port),
        "--served-model-name", model.served_name,
        "--tensor-parallel-size", str(server.tp),
    ]  # fmt: skip
    if server.dp > 1:
        argv += ["--data-parallel-size", str(server.dp)]
    if side.expert_parallel:
        argv += ["--enable-expert-parallel"]
    if server.dcp > 1:
        argv += ["--decode-context-parallel-size", str(server.dcp)]
    if model.block_size:
        argv += ["--block-size", str(model.block_size)]
    argv += ["--max-model-len", str(model.max_model_len)]
    if side.speculative is not None:
        argv += ["--speculative-config", side.speculative.as_json()]
    argv += [
        "--kv-transfer-config", kv_transfer_config(config, server),
        *model.extra_args,
        *side.extra_args,
    ]  # fmt: skip
    return argv


def router_command(config: RunConfig, place: FrontEndPlace = "container") -> list[str]:
    """The front end: vLLM's MoRIIO toy proxy or vllm-router."""
    r = config.router
    if r.kind == "toy-proxy":
        python = "python3" if place == "container" else sys.executable
        return [python, r.toy_proxy, "--port", str(r.port), *r.extra_args]
    dp = max(config.prefill.dp, config.decode.dp)
    argv = [
        "vllm-router",
        "--host", r.bind,
        "--port", str(r.port),
        "--vllm-pd-disaggregation",
        "--kv-connector", "moriio",
        "--vllm-discovery-address", f"{r.bind}:{r.proxy_ping_port}",
        "--policy", r.policy,
        "--prometheus-host", r.bind,
        "--prometheus-port", str(r.prometheus_port),
    ]  # fmt: skip
    if dp > 1:
        argv += ["--intra-node-data-parallel-size", str(dp)]
    return [*argv, *r.extra_args]


def container_name(config: RunConfig, what: str) -> str:
    """``PREFIX-NAME-RUNID-WHAT`` (no run id: ``PREFIX-NAME-WHAT``)."""
    return f"{run_name(config)}-{what}"


def env_flags(env: Mapping[str, str], env_file: str = "") -> list[str]:
    """`--env NAME=VALUE` of every plain variable. A secret goes by name
    only: `--env NAME` (the engine takes the value from its own
    environment), or with ``env_file`` one `--env-file` that holds them."""
    out: list[str] = []
    for key in sorted(env):
        if not is_secret(key):
            out += ["--env", f"{key}={env[key]}"]
        elif not env_file:
            out += ["--env", key]
    if env_file and secret_names(env):
        out += ["--env-file", env_file]
    return out


def docker_run_server(
    config: RunConfig,
    server: Server,
    name: str,
    detach: bool = True,
    env_file: str = "",
) -> list[str]:
    """`docker run` of one server: detached (ssh launcher) or in the
    foreground and removed on exit (one Slurm task per server)."""
    c = config.container
    argv = [c.engine, "run", "--detach" if detach else "--rm", "--name", name]
    argv += label_flags(config)
    argv += [*c.run_flags, *c.extra_run_flags, "--shm-size", c.shm_size]
    if c.cache_dir:
        argv += ["--volume", f"{c.cache_dir}:{CACHE_MOUNT}"]
    for volume in c.volumes:
        argv += ["--volume", volume]
    argv += nic_mounts(config)
    argv += env_flags(server.env, env_file)
    inner = serve_command(config, server)
    return [*argv, "--entrypoint", inner[0], c.image, *inner[1:]]


def binds_nic_userspace(config: RunConfig) -> bool:
    """Whether the servers get the host's NIC userspace provider: `nic.userspace`,
    and for auto, a server whose MORI_RDMA_DEVICES names an ionic device."""
    mode = config.nic.userspace
    if mode != "auto":
        return mode == "on"
    return any(
        d.strip().startswith("ionic")
        for s in servers(config)
        for d in s.env.get("MORI_RDMA_DEVICES", "").split(",")
    )


def nic_mounts(config: RunConfig) -> list[str]:
    """Read-only bind mounts of the host's NIC userspace files, same path."""
    if not binds_nic_userspace(config):
        return []
    out: list[str] = []
    for path in config.nic.userspace_libs:
        out += ["--mount", f"type=bind,source={path},target={path},readonly"]
    return out


def docker_run_router(config: RunConfig, name: str, env_file: str = "") -> list[str]:
    c = config.container
    argv = [c.engine, "run", "--detach", "--name", name, *label_flags(config)]
    argv += ["--network", "host"]
    argv += env_flags(c.env, env_file)
    inner = router_command(config)
    return [*argv, "--entrypoint", inner[0], c.image, *inner[1:]]


def resolve_secrets(
    env: Mapping[str, str], where: str, environ: Mapping[str, str]
) -> dict[str, str]:
    """The secret values of ``env``; one left empty in the config is taken
    from the harness's own environment (``environ``)."""
    out: dict[str, str] = {}
    for name in secret_names(env):
        value = env[name] or environ.get(name, "")
        if not value:
            raise SecretError(
                f"{where}: secret {name} is empty in the config and not set in "
                "the environment of the harness"
            )
        out[name] = value
    return out


def leg_secrets(
    config: RunConfig, environ: Mapping[str, str] | None = None
) -> dict[str, dict[str, str]]:
    """The secret env values of every container of the run, by what runs
    there ("router", "prefill-0", ...): what the launchers hand the
    engine off the command line."""
    environ = os.environ if environ is None else environ
    out = {"router": resolve_secrets(config.container.env, "container.env", environ)}
    for s in servers(config):
        out[s.name] = resolve_secrets(s.env, s.name, environ)
    return out


def node_secrets(
    config: RunConfig, environ: Mapping[str, str] | None = None
) -> dict[str, dict[str, str]]:
    """The secret values of `slurm.node_env`, by node name."""
    environ = os.environ if environ is None else environ
    return {
        node: resolve_secrets(env, f"slurm.node_env.{node}", environ)
        for node, env in config.slurm.node_env.items()
    }
