"""`e2e --reap`: remove the stale containers (or cancel the Slurm jobs) of
one's own earlier runs of a config, found by label (owner and config
prefix) and name prefix; a colleague's run of the same config on the same
nodes carries another owner and is never touched. A run never reaps at
start (the same user may run the same config twice at once): it is an
explicit step."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from vllm_overlay.e2e.config import Reach, RunConfig
from vllm_overlay.e2e.launch import LaunchError, run_command
from vllm_overlay.e2e.plan import on_host, where
from vllm_overlay.e2e.runid import LABEL_NAME, LABEL_OWNER, owner, run_prefix
from vllm_overlay.e2e.servers import servers


class Reaped(msgspec.Struct, forbid_unknown_fields=True):
    """What a reap removed (``host``: the ssh destination, "local" or
    "slurm") and where it could not look."""

    removed: list[tuple[str, str]] = msgspec.field(default_factory=list)
    failed: list[str] = msgspec.field(default_factory=list)


def hosts(config: RunConfig) -> dict[str, Reach]:
    """Every host a container of ``config`` runs on (ssh/local launcher)."""
    found: dict[str, Reach] = {}
    if config.router.container:
        found.setdefault(where(config.router.reach), config.router.reach)
    for s in servers(config):
        found.setdefault(where(s.reach), s.reach)
    return found


def list_command(config: RunConfig) -> list[str]:
    """The names of this user's containers of any run of ``config``."""
    return [
        config.container.engine, "ps", "--all",
        "--filter", f"label={LABEL_NAME}={run_prefix(config)}",
        "--filter", f"label={LABEL_OWNER}={owner()}",
        "--format", "{{.Names}}",
    ]  # fmt: skip


def reap_containers(
    config: RunConfig, say: Callable[[str], None], timeout_s: float
) -> Reaped:
    out = Reaped()
    prefix = run_prefix(config) + "-"
    for host, reach in hosts(config).items():
        argv = on_host(reach, list_command(config))
        try:
            listed = run_command(argv, timeout_s)
        except LaunchError as e:
            out.failed.append(f"{host}: {e}")
            continue
        if listed.returncode != 0:
            err = listed.stderr.decode(errors="replace").strip()[-200:]
            out.failed.append(f"{host}: exit {listed.returncode}: {err}")
            continue
        names = listed.stdout.decode(errors="replace").split()
        for name in (n for n in names if n.startswith(prefix)):
            rm = on_host(reach, [config.container.engine, "rm", "--force", name])
            say(f"[reap @ {host}] {config.container.engine} rm --force {name}")
            try:
                done = run_command(rm, timeout_s)
            except LaunchError as e:
                out.failed.append(f"{host}: {e}")
                continue
            if done.returncode == 0:
                out.removed.append((host, name))
            else:
                out.failed.append(f"{host}: {name}: exit {done.returncode}")
    return out


def reap_jobs(
    config: RunConfig, say: Callable[[str], None], timeout_s: float
) -> Reaped:
    """This user's Slurm jobs of any run of ``config`` (named PREFIX-NAME-RUNID)."""
    out = Reaped()
    prefix = run_prefix(config) + "-"
    argv = ["squeue", "--noheader", "--user", owner(), "--format", "%i %j"]
    try:
        listed = run_command(argv, timeout_s)
    except LaunchError as e:
        return Reaped(failed=[f"slurm: {e}"])
    if listed.returncode != 0:
        err = listed.stderr.decode(errors="replace").strip()[-200:]
        return Reaped(failed=[f"slurm: squeue exit {listed.returncode}: {err}"])
    for line in listed.stdout.decode(errors="replace").splitlines():
        job, _, name = line.strip().partition(" ")
        if not (job.isdigit() and name.startswith(prefix)):
            continue
        say(f"[reap @ slurm] scancel {job}  ({name})")
        try:
            done = run_command(["scancel", job], timeout_s)
        except LaunchError as e:
            out.failed.append(f"slurm: {e}")
            continue
        if done.returncode == 0:
            out.removed.append(("slurm", f"job {job} {name}"))
        else:
            out.failed.append(f"slurm: scancel {job}: exit {done.returncode}")
    return out
