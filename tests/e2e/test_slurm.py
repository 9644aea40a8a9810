"""`--launcher slurm`: the generated sbatch job, and a 2-prefill/1-decode run
submitted to a real Slurm on this machine (controller and three `slurmd -N`
on 127.0.0.1), the stand-in servers answering through the real vllm-router."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import (
    EXAMPLE,
    LOOPBACK,
    SERIES,
    loopback_config,
    standin_nics,
)
from tests.e2e.slurmcluster import LocalSlurm, running_slurm
from vllm_overlay.e2e.config import RunConfig, Slurm
from vllm_overlay.e2e.report import read_report
from vllm_overlay.e2e.runner import run
from vllm_overlay.e2e.servers import HOST_IP, ROUTER_IP
from vllm_overlay.e2e.slurm import SlurmJob, bash_line


def slurm_config(
    tokenizer: Path, prefill: int = 2, decode: int = 1, **overrides: object
) -> RunConfig:
    config = loopback_config(
        tokenizer, prefill, decode, router_container=True, with_addresses=False,
        # Five sweep prompts (each P/D request reads the NIC counters
        # through a job step on the decoder's node, a Slurm round trip).
        checks__sweep_max_len=70, checks__sweep_min_count=1,
        checks__needle_words=[300], checks__prefix_hit_length=300,
        checks__repeat_length=300, **overrides,
    )  # fmt: skip
    # Each node its own RDMA device (the stand-in decoder's NIC counter is
    # that of its node's first device).
    slurm = Slurm(
        address_command=f"echo {LOOPBACK}",
        node_env={
            "n1": {"MORI_RDMA_DEVICES": "ionic_1"},
            "n2": {"MORI_RDMA_DEVICES": "ionic_2", "MORI_IB_GID_INDEX": "1"},
            "n3": {"MORI_RDMA_DEVICES": "ionic_3"},
        },
        cancel_s=60,
        gpus_per_node=0,  # the local cluster has no GPUs to ask for
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
    with running_slurm(tmp_path_factory.mktemp("slurm"), nodes=3) as cluster:
        yield cluster


@pytest.fixture
def on_slurm(
    local_slurm: LocalSlurm, fake_docker: Path, monkeypatch: pytest.MonkeyPatch
) -> LocalSlurm:
    """The module's cluster, which this test's Slurm commands talk to, its
    nodes running containers with the fake docker."""
    monkeypatch.setenv("SLURM_CONF", str(local_slurm.conf))
    return local_slurm


def test_two_prefill_one_decode_through_a_real_slurm(
    on_slurm: LocalSlurm,
    fake_docker: Path,
    tokenizer_json: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = slurm_config(tokenizer_json, **standin_nics(tmp_path, monkeypatch))
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
    # NIC bytes, read by a job step on the decoder's node from its node's
    # device: every P/D request's equal what the decoder loaded.
    node = next(x for x in lines if "[slurm] decode-0 runs at" in x).split()[-1]
    transfer = next(s for s in report.sections if s.name == "transfer per request")
    assert transfer.summary["nic_bytes_total"] == transfer.summary["bytes_total"] > 0
    assert all("NIC received" in c.detail for c in transfer.cases)
    assert report.nic == (
        f"port_rcv_data deltas x 4 on the decode nodes ({node}), per P/D request"
    )
    # The load phase: `vllm bench serve` as a job step on the front end's node.
    router_node = next(x for x in lines if "[slurm] router runs at" in x).split()[-1]
    assert any(x.startswith(f"[load @ slurm node {router_node}]") for x in lines)
    (cell,) = report.load
    assert cell.ok and cell.result is not None and cell.result.completed == 4
    assert cell.result.p99_ttft_ms >= cell.result.p50_ttft_ms > 0
    # The job left the queue and its containers are gone.
    job_id = submitted.split("submitted job ")[1].split(":")[0]
    queue = subprocess.run(
        ["squeue", "--noheader", "--jobs", job_id], env=on_slurm.env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert queue.stdout.strip() == ""
    assert not list(fake_docker.glob("*.json"))


@pytest.mark.usefixtures("on_slurm")
def test_a_server_that_dies_on_its_node_fails_the_slurm_run(
    tokenizer_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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


def test_job_steps_reach_the_decode_and_front_end_nodes(
    tokenizer_json: Path, tmp_path: Path
) -> None:
    # NIC counters: a job step on each decoder's node, the devices its node's
    # node_env names (they win over the server's own env in the node
    # script); the bench: a step on the front end's node, secrets from the
    # front end's env file.
    from vllm_overlay.e2e import slurm
    from vllm_overlay.e2e.runid import with_run_id

    config = with_run_id(
        slurm_config(
            tokenizer_json, decode=2, decode__env={"MORI_RDMA_DEVICES": "mlx5_0"},
            container__env={"HF_TOKEN": "hf-secret-value"},
        ),
        "r8",
    )  # fmt: skip
    launcher = slurm.SlurmLauncher(config, tmp_path, say=lambda _: None)
    launcher.job_id = "42"
    launcher.nodes = {
        "prefill-0": "n1", "prefill-1": "n4", "decode-0": "n2", "decode-1": "n5",
        "router": "n1",
    }  # fmt: skip
    nodes = launcher.nic_nodes()
    assert {n: devices for n, (_, devices) in nodes.items()} == {
        "n2": ["ionic_2"],  # the node's own devices
        "n5": ["mlx5_0"],  # no node_env there: the server's
    }
    place, _ = nodes["n2"]
    assert place(["sh", "-c", "x"]) == [
        "srun", "--jobid=42", "--overlap", "--nodes=1", "--ntasks=1",
        "--nodelist=n2", "--input=none", "--quiet", "sh", "-c", "x",
    ]  # fmt: skip
    host = launcher.bench_host()
    assert host is not None and host.where == "slurm node n1"
    assert host.env_file == str(launcher.job.secrets_dir / "router.env")
    assert host.place(["docker"])[:6] == [
        "srun", "--jobid=42", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n1"
    ]  # fmt: skip
    # The job publishes each task's node name before its address.
    node_script = launcher.job.node_script()
    assert node_script.index('> "$E2E_DIR/node/$WHAT"') < node_script.index(
        '> "$E2E_DIR/addr/$WHAT.tmp"'
    )
    assert "srun --label --overlap" in launcher.job.batch_script()


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


def test_the_job_asks_for_whole_nodes_and_their_gpus(
    example_config: RunConfig, tmp_path: Path
) -> None:
    # Default: --exclusive, and as many GPUs as the largest server uses.
    batch = SlurmJob(example_config, tmp_path).batch_script()
    assert "#SBATCH --gres=gpu:8\n" in batch and "#SBATCH --exclusive\n" in batch
    slurm = msgspec.structs.replace(
        example_config.slurm, gpus_per_node=0, exclusive=False
    )
    batch = SlurmJob(
        msgspec.structs.replace(example_config, slurm=slurm), tmp_path
    ).batch_script()
    assert "--gres" not in batch and "--exclusive" not in batch


def stub(bin_dir: Path, name: str, script: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
    (bin_dir / name).chmod(0o755)


def node_address(config: RunConfig, bin_dir: Path, front_end: bool) -> str:
    """What the job's address lines set on a node with ``bin_dir``'s
    stand-ins for ip, scontrol and getent."""
    from vllm_overlay.e2e.slurm import address_lines

    lines = address_lines(config, "ADDR", front_end)
    script = "\n".join([*lines, 'printf %s "$ADDR"'])
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "ROUTER_IP": "10.9.0.1",
        "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURMD_NODENAME": "gpu1",
    }  # fmt: skip
    return subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout


def test_a_nodes_address_comes_from_the_interface_it_names_or_routes_through(
    example_config: RunConfig, tmp_path: Path
) -> None:
    # A node with two interfaces: `hostname -I` would say the management
    # one first; the address is the backend one.
    bin_dir = tmp_path / "bin"
    stub(bin_dir, "hostname", 'echo "192.168.0.5 10.9.0.7"')
    stub(
        bin_dir, "ip",
        'case "$*" in\n'
        '"-o -4 route get 10.9.0.1"|"-o -4 route get 10.9.0.2") '
        'echo "$5 dev ens2 src 10.9.0.7 uid 0";;\n'
        '"-o -4 addr show dev ens9") '
        'echo "4: ens9    inet 172.20.1.4/24 brd 172.20.1.255 scope global ens9";;\n'
        "*) exit 2;;\nesac",
    )  # fmt: skip
    stub(bin_dir, "scontrol", 'printf "gpu1\\ngpu2\\n"')
    stub(bin_dir, "getent", 'echo "10.9.0.2        STREAM gpu2"')
    slurm = example_config.slurm
    assert slurm.address_command == "" and slurm.interface == ""
    # A server: the interface routing to the front end.
    assert node_address(example_config, bin_dir, front_end=False) == "10.9.0.7"
    # The front end's node: the interface routing to the job's next node.
    assert node_address(example_config, bin_dir, front_end=True) == "10.9.0.7"
    named = msgspec.structs.replace(
        example_config, slurm=msgspec.structs.replace(slurm, interface="ens9")
    )
    assert node_address(named, bin_dir, front_end=False) == "172.20.1.4"
    assert node_address(named, bin_dir, front_end=True) == "172.20.1.4"
    given = msgspec.structs.replace(
        example_config,
        slurm=msgspec.structs.replace(slurm, address_command="echo 10.1.1.1"),
    )
    assert node_address(given, bin_dir, front_end=False) == "10.1.1.1"
    # The scripts use them; `hostname -I` is gone.
    job = SlurmJob(example_config, tmp_path)
    for script in (job.batch_script(), job.node_script()):
        assert "hostname -I" not in script and "route get" in script


def test_a_bad_interface_name_is_refused(example_config: RunConfig) -> None:
    from vllm_overlay.e2e.config import ConfigError, decode_config

    text = EXAMPLE.read_text() + '\n[slurm]\ninterface = "-x; reboot"\n'
    with pytest.raises(ConfigError, match=r"slurm\.interface: must be a network"):
        decode_config(text)


def test_the_node_script_gives_the_container_the_nodes_render_gid(
    example_config: RunConfig, tmp_path: Path
) -> None:
    from vllm_overlay.e2e.servers import RENDER_GID_SH

    node = SlurmJob(example_config, tmp_path).node_script()
    assert '--group-add video --group-add "${RENDER_GID}"' in node
    assert RENDER_GID_SH.replace(">&2;", '>> "$LOG";') in node
    assert node.index("RENDER_GID=") < node.index("--group-add video")
