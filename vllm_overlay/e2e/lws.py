"""A Kubernetes manifest for a run: one LeaderWorkerSet per side (the way
vLLM documents multi-node serving on Kubernetes), the front end as a
Deployment with a Service. `vllm-overlay e2e --config F --emit lws` prints
it as JSON (`kubectl apply -f -` reads JSON); the harness then runs the
checks against it with `--launcher attach`. See docs/e2e.md.

Every server is one pod (one group of size 1) on the host network, so that
MoRI reaches the node's RDMA NICs; its MoRIIO host_ip is the pod's IP,
its proxy_ip the front end's Service.
"""

from __future__ import annotations

from typing import Any

from vllm_overlay.e2e.config import ROLES, RunConfig
from vllm_overlay.e2e.secret import is_secret
from vllm_overlay.e2e.servers import (
    HOST_IP,
    ROUTER_IP,
    router_command,
    serve_command,
    servers,
    unplaced,
)

LWS_API = "leaderworkerset.x-k8s.io/v1"
GPU_RESOURCE = "amd.com/gpu"  # the AMD GPU device plugin's resource
EXCLUSIVE = "leaderworkerset.sigs.k8s.io/exclusive-topology"


def secret_name(config: RunConfig) -> str:
    """The Kubernetes Secret the pods read secret env values from."""
    return f"{config.name}-env"


def env_var(config: RunConfig, name: str, value: str) -> dict[str, Any]:
    """A container env entry; a secret is a reference into the run's
    Secret (created by the user), never its value."""
    if is_secret(name):
        ref = {"name": secret_name(config), "key": name}
        return {"name": name, "valueFrom": {"secretKeyRef": ref}}
    return {"name": name, "value": value}


def fill(word: str, router_host: str) -> str:
    return word.replace(HOST_IP, "$(POD_IP)").replace(ROUTER_IP, router_host)


def volumes(config: RunConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Pod volumes and container mounts: /dev/shm, the cache, the config's
    host:container[:ro] bind mounts."""
    c = config.container
    vols: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": c.shm_size}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    binds = [f"{c.cache_dir}:/cache"] if c.cache_dir else []
    for i, spec in enumerate([*binds, *c.volumes]):
        host, container, *mode = spec.split(":")
        name = f"host-{i}"
        vols.append(
            {"name": name, "hostPath": {"path": host, "type": "DirectoryOrCreate"}}
        )
        mounts.append(
            {"name": name, "mountPath": container, "readOnly": mode == ["ro"]}
        )
    return vols, mounts


def server_set(config: RunConfig, role: str, router_host: str) -> dict[str, Any]:
    side_servers = [s for s in servers(config) if s.role == role]
    first = side_servers[0]
    argv = [fill(w, router_host) for w in serve_command(config, first)]
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    env += [env_var(config, k, v) for k, v in sorted(first.env.items())]
    vols, mounts = volumes(config)
    health = {"httpGet": {"path": "/health", "port": first.http_port}}
    t = config.timeouts
    container = {
        "name": "vllm",
        "image": config.container.image,
        "command": [argv[0]],
        "args": argv[1:],
        "env": env,
        "resources": {"limits": {GPU_RESOURCE: first.gpus}},
        "securityContext": {
            "capabilities": {"add": ["IPC_LOCK", "SYS_PTRACE"]},
            "seccompProfile": {"type": "Unconfined"},
        },
        "startupProbe": {
            **health,
            "periodSeconds": 10,
            "failureThreshold": int(t.health_s // 10),
        },
        "readinessProbe": {**health, "periodSeconds": 10},
        "volumeMounts": mounts,
    }
    name = f"{config.name}-{role}"
    pod = {
        "metadata": {"labels": {"app": config.name, "role": role}},
        "spec": {
            "hostNetwork": True,
            "hostIPC": True,
            "dnsPolicy": "ClusterFirstWithHostNet",
            "containers": [container],
            "volumes": vols,
        },
    }
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": {
            "name": name,
            # One server per node: they listen on the host network.
            "annotations": {EXCLUSIVE: "kubernetes.io/hostname"},
        },
        "spec": {
            "replicas": len(side_servers),
            "leaderWorkerTemplate": {"size": 1, "workerTemplate": pod},
        },
    }


def manifest(config: RunConfig) -> dict[str, Any]:
    """Every object of the run, as a Kubernetes List."""
    config = unplaced(config)
    router_host = f"{config.name}-router"
    r = config.router
    argv = router_command(config)
    labels = {"app": config.name, "role": "router"}
    ports = [
        {"name": "http", "port": r.port},
        {"name": "discovery", "port": r.proxy_ping_port},
    ]
    router = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": router_host},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "router",
                            "image": config.container.image,
                            "command": [argv[0]],
                            "args": argv[1:],
                            "ports": [{"containerPort": p["port"]} for p in ports],
                        }
                    ]
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": router_host},
        "spec": {"selector": labels, "ports": ports},
    }
    items = [
        router,
        service,
        *(server_set(config, role, router_host) for role in ROLES),
    ]
    return {"apiVersion": "v1", "kind": "List", "items": items}
