"""Secret env values (issue 41, finding 6): a planted token reaches the
containers, and no command line, plan, log, script, report or printed
line holds it. Runs go through a fake `ssh` and a fake `docker` that record
their command lines (what `ps` shows on every node) and, per container,
the sha256 of each env value the engine set."""

from __future__ import annotations

import hashlib
import json
import stat
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import BANNER, EXAMPLE, SERIES, loopback_config, write_config
from tests.e2e.test_slurm import slurm_config
from vllm_overlay.cli import main
from vllm_overlay.e2e.cli import series_patches
from vllm_overlay.e2e.config import Reach, RunConfig, encode_config, load_config
from vllm_overlay.e2e.lws import manifest
from vllm_overlay.e2e.plan import build_plan
from vllm_overlay.e2e.report import read_report
from vllm_overlay.e2e.runid import with_run_id
from vllm_overlay.e2e.runner import run
from vllm_overlay.e2e.secret import is_secret
from vllm_overlay.e2e.slurm import SlurmJob

TOKEN = "hf_PlantedToken0123456789abcdefXYZ"
KEY = "sk-planted-api-key-9876543210"
SHA = hashlib.sha256(TOKEN.encode()).hexdigest()


def planted(config: RunConfig) -> RunConfig:
    """``config`` with HF_TOKEN for every container and an API key on the
    decode server only."""
    container = msgspec.structs.replace(
        config.container, env={**config.container.env, "HF_TOKEN": TOKEN}
    )
    decode = config.decode
    first = msgspec.structs.replace(
        decode.instances[0], env={**decode.instances[0].env, "VLLM_API_KEY": KEY}
    )
    decode = msgspec.structs.replace(decode, instances=[first, *decode.instances[1:]])
    return msgspec.structs.replace(config, container=container, decode=decode)


def files_under(*roots: Path) -> Iterator[Path]:
    for root in roots:
        if root.is_file():
            yield root
        elif root.is_dir():
            yield from (p for p in sorted(root.rglob("*")) if p.is_file())


def holders(
    secret: str, *roots: Path, texts: dict[str, str] | None = None
) -> list[str]:
    """Every file under ``roots`` and every named text that holds ``secret``."""
    found = [str(p) for p in files_under(*roots) if secret.encode() in p.read_bytes()]
    found += [name for name, text in (texts or {}).items() if secret in text]
    return found


def test_secret_names() -> None:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "VLLM_API_KEY",
                 "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "hf_token"):  # fmt: skip
        assert is_secret(name), name
    for name in ("HF_HUB_OFFLINE", "MORI_RDMA_DEVICES", "VLLM_LOGGING_LEVEL"):
        assert not is_secret(name), name


@pytest.mark.parametrize("launcher", ["ssh", "slurm", "attach"])
def test_the_dry_run_shows_secrets_masked(
    launcher: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(planted(load_config(EXAMPLE)), tmp_path / "run.toml")
    run_dir = tmp_path / "run"
    argv = ["e2e", "--config", str(path), "--dry-run", "--launcher", launcher]
    assert main([*argv, "--run-dir", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    assert TOKEN not in out + err and KEY not in out + err
    assert not run_dir.exists()  # a dry run writes nothing
    if launcher == "ssh":
        assert "HF_TOKEN=***" in out and "VLLM_API_KEY=***" in out
        assert "--env HF_TOKEN " in out and "--env VLLM_API_KEY " in out
    if launcher == "slurm":
        assert "--env-file" in out and "HF_TOKEN=***" in out


def test_the_plan_passes_secrets_by_name_and_the_report_masks_them() -> None:
    config = planted(load_config(EXAMPLE))
    plan = build_plan(config)
    encoded = msgspec.json.encode(plan).decode()
    assert TOKEN not in encoded and KEY not in encoded
    starts = {s.what: s for s in plan.setup if s.action == "start"}
    assert starts["prefill-0"].secret_env == ["HF_TOKEN"]
    assert starts["decode-0"].secret_env == ["HF_TOKEN", "VLLM_API_KEY"]
    data = encode_config(config)
    assert TOKEN not in json.dumps(data) and KEY not in json.dumps(data)
    assert data["container"]["env"]["HF_TOKEN"] == "***"  # type: ignore[index]
    assert data["container"]["env"]["HF_HUB_OFFLINE"] == "1"  # type: ignore[index]


def test_the_lws_manifest_refers_to_a_kubernetes_secret(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write_config(planted(load_config(EXAMPLE)), tmp_path / "run.toml")
    assert main(["e2e", "--config", str(path), "--emit", "lws"]) == 0
    out = capsys.readouterr().out
    assert TOKEN not in out and KEY not in out
    doc = manifest(load_config(path))
    pod = doc["items"][2]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "llama-smoke-env", "key": "HF_TOKEN"}},
    }
    assert env["HF_HUB_OFFLINE"] == {"name": "HF_HUB_OFFLINE", "value": "1"}


def over_ssh(config: RunConfig) -> RunConfig:
    """Every server reached over ssh (the fake one runs it here)."""
    sides = {
        role: msgspec.structs.replace(
            config.side(role),
            instances=[
                msgspec.structs.replace(i, reach=Reach(ssh=f"node-{role}"))
                for i in config.side(role).instances
            ],
        )
        for role in ("prefill", "decode")
    }
    return msgspec.structs.replace(config, **sides)


def test_a_run_over_ssh_hands_the_token_to_the_containers_and_nowhere_else(
    fake_docker: Path, fake_ssh: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # The decode server logs its API key: the collected log masks it.
    monkeypatch.setenv("STANDIN_LEAK", "VLLM_API_KEY")
    found = series_patches()
    assert found is not None
    monkeypatch.setenv("STANDIN_BANNER", BANNER.replace(SERIES, found[0]))
    config = over_ssh(planted(loopback_config(tokenizer_json)))
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    path = write_config(config, inputs / "run.toml")  # the only file with them
    run_dir = tmp_path / "run"
    # A fake engine: no model for vLLM's preflight to build.
    argv = ["e2e", "--config", str(path), "--run-dir", str(run_dir), "--no-preflight"]
    code = main([*argv, "--run-id", "r1"])
    out, err = capsys.readouterr()
    report = read_report(run_dir / "report.json")
    assert code == 0, (report.error, out[-2000:])
    assert report.preflight.startswith("skipped (--no-preflight)")
    # It reached every container that needs it, through the engine's env.
    for what in ("prefill-0", "decode-0"):
        env = json.loads(
            (fake_docker / "env" / f"moriio-e2e-loop-r1-{what}.json").read_text()
        )
        assert env["HF_TOKEN"] == SHA, what
    decode = json.loads(
        (fake_docker / "env" / "moriio-e2e-loop-r1-decode-0.json").read_text()
    )
    assert decode["VLLM_API_KEY"] == hashlib.sha256(KEY.encode()).hexdigest()
    # The commands went through ssh, with the secrets by name only.
    ssh_calls = [json.loads(x) for x in fake_ssh.read_text().splitlines()]
    assert any("docker run --detach" in " ".join(c) for c in ssh_calls)
    texts = {"stdout": out, "stderr": err}
    for secret in (TOKEN, KEY):
        assert holders(secret, run_dir, fake_docker, fake_ssh, texts=texts) == []
    docker_calls = (fake_docker / "calls.jsonl").read_text()
    assert '"--env", "HF_TOKEN"' in docker_calls
    assert "HF_TOKEN=***" in out
    assert "VLLM_API_KEY=***" in (run_dir / "logs" / "decode-0.log").read_text()


def test_slurm_env_files_are_private_and_hold_only_the_secrets(
    tokenizer_json: Path, tmp_path: Path
) -> None:
    config = planted(slurm_config(tokenizer_json, prefill=1))
    slurm = msgspec.structs.replace(
        config.slurm,
        node_env={"n2": {"MORI_IB_GID_INDEX": "1", "NODE_PASSWORD": "pw-node-2-x"}},
    )
    job = SlurmJob(msgspec.structs.replace(config, slurm=slurm), tmp_path / "run")
    job.write()
    for script in (job.batch, job.node):
        text = script.read_text()
        assert TOKEN not in text and KEY not in text and "pw-node-2-x" not in text
    node = job.node.read_text()
    assert f"--env-file {job.secrets_dir}/decode-0.env" in node
    assert (
        f"NODE_ENV=(--env MORI_IB_GID_INDEX=1 --env-file {job.secrets_dir}/node-0.env)"
        in node
    )
    assert stat.S_IMODE(job.secrets_dir.stat().st_mode) == 0o700
    files = {p.name: p for p in job.secrets_dir.iterdir()}
    assert sorted(files) == [
        "decode-0.env",
        "node-0.env",
        "prefill-0.env",
        "router.env",
    ]
    for f in files.values():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert (
        files["decode-0.env"].read_text() == f"HF_TOKEN={TOKEN}\nVLLM_API_KEY={KEY}\n"
    )
    assert files["node-0.env"].read_text() == "NODE_PASSWORD=pw-node-2-x\n"
    job.remove_secrets()
    assert not job.secrets_dir.exists()


def test_a_secret_left_empty_comes_from_the_harness_environment(
    tokenizer_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    config = loopback_config(tokenizer_json, container__env={"HF_TOKEN": ""})
    monkeypatch.delenv("HF_TOKEN", raising=False)
    path = write_config(config, tmp_path / "run.toml")
    argv = ["e2e", "--config", str(path), "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: container.env: secret HF_TOKEN is empty in the config and not set "
        "in the environment of the harness\n"
    )
    assert not (tmp_path / "run").exists()  # nothing started
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    job = SlurmJob(config, tmp_path / "slurm-run")
    job.write()
    assert (job.secrets_dir / "prefill-0.env").read_text() == f"HF_TOKEN={TOKEN}\n"


def test_a_slurm_run_hands_the_token_to_the_containers_and_removes_it(
    local_slurm: object, fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("SLURM_CONF", str(local_slurm.conf))  # type: ignore[attr-defined]
    config = with_run_id(planted(slurm_config(tokenizer_json, prefill=1)), "r1")
    lines: list[str] = []
    report = run(
        config, tmp_path / "run", SERIES, say=lines.append, launcher_kind="slurm"
    )
    assert report.ok, (report.error, lines[-5:])
    for what in ("prefill-0", "decode-0"):
        env = json.loads(
            (fake_docker / "env" / f"moriio-e2e-loop-r1-{what}.json").read_text()
        )
        assert env["HF_TOKEN"] == SHA, what
    assert not (tmp_path / "run" / "slurm" / "secrets").exists()
    texts = {"said": "\n".join(lines)}
    for secret in (TOKEN, KEY):
        assert holders(secret, tmp_path / "run", fake_docker, texts=texts) == []


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from tests.e2e.slurmcluster import running_slurm

    with running_slurm(tmp_path_factory.mktemp("slurm"), nodes=2) as cluster:
        yield cluster
