"""The bytes the decode nodes' RDMA NICs receive per P/D request: the
`port_rcv_data` counter of every port of the node's RDMA devices (those of
`MORI_RDMA_DEVICES` when the server sets it), read on the node before and
after the request (over ssh, or here for a local node).

`port_rcv_data` counts 4-byte words (the InfiniBand PortRcvData counter:
octets divided by four), on RoCE NICs too: the bytes are the delta times
four. A READ's payload arrives at the decoder (it issues the READs), so the
decode node's receive counter is what the transfer moved, plus any other
traffic of that NIC in the meantime.

Over ssh (or here) a node is reached by its server's `reach`; in a Slurm
job by a job step on the node (`srun --jobid ... --overlap`), its devices
those of the node's `slurm.node_env` when it names them."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from functools import partial

from vllm_overlay.e2e.config import Reach, RunConfig
from vllm_overlay.e2e.launch import LaunchError, run_command
from vllm_overlay.e2e.plan import on_host, where
from vllm_overlay.e2e.servers import servers

WORD_BYTES = 4
COUNTER = "ports/*/counters/port_rcv_data"
DEVICES_ENV = "MORI_RDMA_DEVICES"

# (argv, timeout) -> (exit status, stdout)
Runner = Callable[[list[str], float], tuple[int, str]]
# argv -> the command that runs argv on a node
Place = Callable[[list[str]], list[str]]


def devices_of(env: Mapping[str, str]) -> list[str]:
    """The RDMA devices ``env``'s `MORI_RDMA_DEVICES` names ([]: all)."""
    return [d.strip() for d in env.get(DEVICES_ENV, "").split(",") if d.strip()]


def read_script(root: str, devices: list[str]) -> str:
    """Prints `PATH WORDS` for every counter file of ``devices`` (all
    devices when none) under ``root``; nothing when there is none."""
    base = shlex.quote(root.rstrip("/") or "/")
    globs = " ".join(f"{base}/{shlex.quote(d)}/{COUNTER}" for d in devices) or (
        f"{base}/*/{COUNTER}"
    )
    return (
        f'for f in {globs}; do [ -r "$f" ] && printf "%s %s\\n" "$f" "$(cat "$f")"; '
        "done; true"
    )


def parse(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        path, _, value = line.rpartition(" ")
        if path and value.isdigit():
            out[path] = int(value)
    return out


def delta_bytes(before: dict[str, int], after: dict[str, int]) -> int:
    """Bytes received between two reads; counters that went back (a reset)
    count from zero."""
    words = 0
    for path, value in after.items():
        start = before.get(path, 0)
        words += value - start if value >= start else value
    return words * WORD_BYTES


def _run(argv: list[str], timeout_s: float) -> tuple[int, str]:
    done = run_command(argv, timeout_s)
    return done.returncode, done.stdout.decode(errors="replace")


class NicCounters:
    """Reads every decode node's counters (one command per node)."""

    def __init__(
        self,
        config: RunConfig,
        runner: Runner = _run,
        nodes: Mapping[str, tuple[Place, list[str]]] | None = None,
    ) -> None:
        """``nodes``: every decode node by name, how to run a command there
        and its RDMA devices; default: the decode servers' hosts (ssh)."""
        self.timeout_s = config.timeouts.command_s
        self.runner = runner
        self.nodes: dict[str, tuple[Place, list[str]]] = {}
        self.scripts: dict[str, list[str]] = {}
        self.failed = ""
        root = config.nic.counters_root
        if not root:
            return
        self.nodes = dict(ssh_nodes(config) if nodes is None else nodes)
        self.scripts = {
            host: ["sh", "-c", read_script(root, devices)]
            for host, (_, devices) in self.nodes.items()
        }

    def read(self) -> dict[str, dict[str, int]] | None:
        """Every node's counters; None when one cannot be read (said once
        in ``failed``) or no node has any."""
        if not self.nodes or self.failed:
            return None
        out: dict[str, dict[str, int]] = {}
        for host, (place, _) in self.nodes.items():
            try:
                code, text = self.runner(place(self.scripts[host]), self.timeout_s)
            except LaunchError as e:
                self.failed = f"{host}: {e}"
                return None
            found = parse(text)
            if code != 0 or not found:
                self.failed = f"{host}: no RDMA port counters (exit {code})"
                return None
            out[host] = found
        return out


def ssh_nodes(config: RunConfig) -> dict[str, tuple[Place, list[str]]]:
    """The decode servers' hosts (one entry per host), reached as their
    servers are, with the devices of every server there."""
    nodes: dict[str, tuple[Reach, list[str]]] = {}
    for s in servers(config, "decode"):
        host = where(s.reach)
        known = nodes.get(host)
        merged = sorted({*(known[1] if known else []), *devices_of(s.env)})
        nodes[host] = (s.reach, merged)
    return {
        host: (partial(on_host, reach), devices)
        for host, (reach, devices) in nodes.items()
    }


def moved(
    before: dict[str, dict[str, int]] | None, after: dict[str, dict[str, int]] | None
) -> int:
    """Bytes all decode nodes received between two reads; -1: not read."""
    if before is None or after is None:
        return -1
    return sum(delta_bytes(before.get(h, {}), after[h]) for h in after)
