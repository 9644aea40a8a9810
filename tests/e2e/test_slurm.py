"""`--launcher slurm`: the generated sbatch job, and a 2-prefill/1-decode run
submitted to a real Slurm on this machine (controller and three `slurmd -N`
on 127.0.0.1), the stand-in servers answering through the real vllm-router."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import LOOPBACK, SERIES, loopback_config
from tests.e2e.slurmcluster import LocalSlurm, ensure_installed
from vllm_overlay.e2e.config import RunConfig, Slurm
from vllm_overlay.e2e.report import read_report
from vllm_overlay.e2e.runner import run
from vllm_overlay.e2e.servers import HOST_IP, ROUTER_IP
from vllm_overlay.e2e.slurm import SlurmJob, bash_line


def slurm_config(tokenizer: Path, prefill: int = 2, decode: int = 1) -> RunConfig:
    config = loopback_config(
        tokenizer, prefill, decode, router_container=True, with_addresses=False,
        checks__sweep_max_len=200, checks__sweep_min_count=10,
        checks__needle_words=[300], checks__prefix_hit_length=300,
        checks__repeat_length=300,
    )  # fmt: skip
    slurm = Slurm(
        address_command=f"echo {LOOPBACK}",
        node_env={"n2": {"MORI_RDMA_DEVICES": "ionic_2", "MORI_IB_GID_INDEX": "1"}},
        cancel_s=60,
    )
    return msgspec.structs.replace(config, slurm=slurm)


def test_bash_words_expand_placeholders_only() -> None:
    line = bash_line(["echo", f'{{"host_ip":"{HOST_IP}","p":"{ROUTER_IP}"}}', "a b"])
    out = subprocess.run(
        ["bash", "-c", f"HOST_IP=10.1.1.1; ROUTER_IP=10.9.9.9; {line}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out == '{"host_ip":"10.1.1.1","p":"10.9.9.9"} a b\n'


def test_job_maps_ranks_to_servers(tokenizer_json: Path, tmp_path: Path) -> None:
    job = SlurmJob(slurm_config(tokenizer_json), tmp_path)
    batch, node = job.batch_script(), job.node_script()
    assert "#SBATCH --nodes=3" in batch and "#SBATCH --ntasks-per-node=1" in batch
    assert "#   0: prefill-0\n#   1: prefill-1\n#   2: decode-0" in batch
    assert "srun --label" in batch
    for i, what in enumerate(("prefill-0", "prefill-1", "decode-0")):
        assert f"  {i}) WHAT={what} ;;" in node
    # Per-node RDMA env, by Slurm node name.
    assert (
        "n2) NODE_ENV=(--env MORI_IB_GID_INDEX=1 --env MORI_RDMA_DEVICES=ionic_2)"
        in node
    )
    # The image's toy proxy or router runs in the batch step on the first node.
    assert "--entrypoint vllm-router" in batch
    for script in (batch, node):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert '\\"host_ip\\":\\"' not in node  # JSON stays single-quoted
    assert '"host_ip":"\'"${HOST_IP}"\'"' in node


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    why = ensure_installed()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_two_prefill_one_decode_through_a_real_slurm(
    local_slurm: LocalSlurm,
    fake_docker: Path,
    tokenizer_json: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_CONF", str(local_slurm.conf))
    config = slurm_config(tokenizer_json)
    lines: list[str] = []
    report = run(
        config, tmp_path / "run", SERIES, say=lines.append, launcher_kind="slurm"
    )
    failures = {
        s.name: [c.detail for c in s.cases if c.status == "fail"][:2]
        for s in report.sections
    }
    assert report.ok, (report.error, failures, lines[-5:])
    assert read_report(tmp_path / "run" / "report.json").launcher == "slurm"
    logs = tmp_path / "run" / "logs"
    # Both prefill servers took P/D prefills (round robin), the decode server
    # took every decode, each from its own node's task.
    for what in ("prefill-0", "prefill-1"):
        assert "kv=do_remote_decode" in (logs / f"{what}.log").read_text(), what
    assert "kv=remote_block_ids" in (logs / "decode-0.log").read_text()
    submitted = next(line for line in lines if "submitted job" in line)
    assert "rank 0 prefill-0, rank 1 prefill-1, rank 2 decode-0" in submitted
    # The job left the queue and its containers are gone.
    job_id = submitted.split("submitted job ")[1].split(":")[0]
    queue = subprocess.run(
        ["squeue", "--noheader", "--jobs", job_id], env=local_slurm.env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert queue.stdout.strip() == ""
    assert not list(fake_docker.glob("*.json"))


def test_a_server_that_dies_on_its_node_fails_the_slurm_run(
    local_slurm: LocalSlurm,
    fake_docker: Path,
    tokenizer_json: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_CONF", str(local_slurm.conf))
    monkeypatch.setenv("FAKE_DOCKER_DIE", "decode-0")
    config = slurm_config(tokenizer_json, prefill=1)
    config = msgspec.structs.replace(
        config, timeouts=msgspec.structs.replace(config.timeouts, health_s=3600)
    )
    report = run(
        config, tmp_path / "run", SERIES, say=lambda _: None, launcher_kind="slurm"
    )
    assert not report.ok
    launch = report.sections[0]
    assert launch.name == "launch" and launch.status == "fail"
    assert launch.cases[0].id == "decode-0"
    assert "exited (exit 3)" in launch.cases[0].detail
    assert "no RDMA device matches MORI_RDMA_DEVICES" in launch.cases[0].detail


def recorded_commands(
    monkeypatch: pytest.MonkeyPatch, module: object, stdout: bytes = b""
) -> list[list[str]]:
    """Every command ``module`` runs through ``run_command``, answered with
    exit 0 and ``stdout``, no real program started."""
    calls: list[list[str]] = []

    def fake(argv: list[str], timeout_s: float, stdin: bytes | None = None) -> object:
        calls.append(list(argv))
        return subprocess.CompletedProcess(argv, 0, stdout, b"")

    monkeypatch.setattr(module, "run_command", fake)
    return calls


def test_a_job_submitted_when_interrupted_is_cancelled_by_its_run_name(
    tokenizer_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C while sbatch runs: the harness never read the job id; the job
    # (if sbatch made one) carries the run's name and is cancelled by it.
    from vllm_overlay.e2e import slurm
    from vllm_overlay.e2e.runid import owner, with_run_id

    config = with_run_id(slurm_config(tokenizer_json), "r7")
    launcher = slurm.SlurmLauncher(config, tmp_path, say=lambda _: None)
    assert "#SBATCH --job-name=moriio-e2e-loop-r7\n" in launcher.job.batch_script()
    assert 'NAME="moriio-e2e-loop-r7-$WHAT"' in launcher.job.node_script()
    calls = recorded_commands(monkeypatch, slurm)
    launcher.submitted = True
    launcher.close()
    assert calls == [["scancel", "--name", "moriio-e2e-loop-r7", "--user", owner()]]


def test_reap_cancels_ones_own_jobs_of_the_config_only(
    tokenizer_json: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_overlay.e2e import reap
    from vllm_overlay.e2e.runid import owner

    listing = b"101 moriio-e2e-loop-r1\n102 moriio-e2e-loopy-r2\n103 other-job\n"
    calls = recorded_commands(monkeypatch, reap, listing)
    done = reap.reap_jobs(slurm_config(tokenizer_json), lambda _: None, 30)
    assert calls[0] == [
        "squeue", "--noheader", "--user", owner(), "--format", "%i %j"
    ]  # fmt: skip
    assert calls[1:] == [["scancel", "101"]]
    assert done.removed == [("slurm", "job 101 moriio-e2e-loop-r1")]
