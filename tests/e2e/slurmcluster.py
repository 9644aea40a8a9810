"""A real Slurm cluster on this machine, on 127.0.0.1: MUNGE, a controller
and one `slurmd -N nodeN` per virtual node, each with its own port and spool
directory, all under one temporary directory (nothing in /etc is touched).
Debian's slurm-wlm and munge provide the daemons; `ensure_installed`
installs them with apt-get when the test runs as root (CI does)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.e2e.ports import free_port

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
APT_PACKAGES = ("slurm-wlm", "munge")


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None]


def ensure_installed() -> str:
    """'' when the daemons are there (installing them if we can), else why not."""
    if not missing_programs():
        return ""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return (
            f"{', '.join(missing_programs())} missing; installing "
            f"{' '.join(APT_PACKAGES)} needs root and apt-get"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", *APT_PACKAGES]
    for argv in (install, ["apt-get", "update", "-q"], install):
        try:
            done = subprocess.run(argv, env=env, capture_output=True, timeout=900)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(argv)}` took over 900 s"
        if argv is install and done.returncode == 0:
            break
    if missing_programs():
        err = done.stderr.decode(errors="replace").strip()[-300:]
        return f"apt-get could not install {' '.join(APT_PACKAGES)}: {err}"
    return ""


class LocalSlurm:
    """Start with `start()`, stop with `stop()`: only the daemons it started."""

    def __init__(self, root: Path, nodes: int) -> None:
        self.root = root
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self, timeout_s: float = 60) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700, parents=True)
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        sock = munge / "munge.socket"
        self.spawn(
            [
                "munged", "--foreground", "--force", f"--socket={sock}",
                f"--key-file={key}", f"--log-file={munge}/munged.log",
                f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed",
            ],
            "munged",
        )  # fmt: skip
        self.wait(lambda: sock.exists(), timeout_s, "munged socket")
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True)
        (self.root / "state").mkdir()
        (self.root / "plugstack.conf").write_text("")
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=e2e",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={sock}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.root}/state",
            f"SlurmdSpoolDir={self.root}/spool/%n",
            f"SlurmctldPidFile={self.root}/slurmctld.pid",
            f"SlurmdPidFile={self.root}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root}/slurmctld.log",
            f"SlurmdLogFile={self.root}/slurmd-%n.log",
            f"PlugStackConfig={self.root}/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "KillWait=5",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 "
                f"Port={free_port()} CPUs=1 RealMemory=500 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=e2e Nodes={','.join(self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        self.spawn(["slurmctld", "-D", "-i"], "slurmctld")
        for node in self.nodes:
            self.spawn(["slurmd", "-D", "-N", node], f"slurmd-{node}")
        self.wait(self.all_idle, timeout_s, "every node idle")

    def spawn(self, argv: list[str], name: str) -> None:
        out = (self.root / f"{name}.out").open("wb")
        self.procs.append(
            subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        )
        out.close()

    def all_idle(self) -> bool:
        done = subprocess.run(
            ["sinfo", "--noheader", "--Node", "--format", "%N %t"],
            env=self.env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def wait(self, ready, timeout_s: float, what: str) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while not ready():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"{p.args[0]} exited with {p.returncode}: {self.logs()}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"local slurm: no {what} after {timeout_s}s: {self.logs()}"
                )
            time.sleep(0.3)

    def logs(self) -> str:
        tails = []
        for f in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            text = f.read_text(errors="replace").strip().splitlines()[-3:]
            tails.append(f"{f.name}: {' | '.join(text)}")
        return "; ".join(tails)[-2000:]

    def stop(self) -> None:
        """Stop the daemons started here (controller and slurmds first)."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs.clear()


@contextmanager
def running_slurm(directory: Path, nodes: int) -> Iterator[LocalSlurm]:
    """A started local Slurm of ``nodes`` nodes in ``directory``, stopped
    afterwards; the test is skipped where Slurm cannot be installed."""
    import pytest

    why = ensure_installed()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    cluster = LocalSlurm(directory, nodes=nodes)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
