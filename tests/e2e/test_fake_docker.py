"""The harness against a fake `docker` on PATH (tests/e2e/fakedocker.py):
containers are local stand-in processes, so liveness, the pull step and a
whole run through containers are exercised without a Docker engine."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import BANNER, SERIES, loopback_config, write_config
from vllm_overlay.cli import main
from vllm_overlay.e2e.config import RunConfig
from vllm_overlay.e2e.report import read_report
from vllm_overlay.e2e.runid import with_run_id
from vllm_overlay.e2e.runner import run

PULL_S = 3.0


def with_timeouts(config: RunConfig, **kw: float) -> RunConfig:
    return msgspec.structs.replace(
        config, timeouts=msgspec.structs.replace(config.timeouts, **kw)
    )


def test_a_container_that_exits_at_start_fails_the_run_at_once(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # The decode server dies during start-up (a MoRI device assert). The
    # health wait allows an hour: only the liveness check can end the run.
    monkeypatch.setenv("FAKE_DOCKER_DIE", "decode-0")
    config = with_timeouts(loopback_config(tokenizer_json), health_s=3600)
    config = with_run_id(config, "r1")
    said: list[str] = []
    report = run(config, tmp_path, SERIES, say=said.append)
    assert not report.ok
    assert report.error.startswith("ContainerExited: decode-0 @ local exited (exit 3)")
    launch = report.sections[0]
    assert (launch.name, launch.status) == ("launch", "fail")
    assert launch.cases[0].id == "decode-0"
    detail = launch.cases[0].detail
    assert "no RDMA device matches MORI_RDMA_DEVICES" in detail
    assert "EngineCore failed to start." in detail
    md = (tmp_path / "report.md").read_text()
    assert "RdmaContext::Initialize" in md and md.startswith("# MoRIIO E2E: FAIL")
    # The dead container's log is collected and every container removed.
    assert "EngineCore failed" in (tmp_path / "logs" / "decode-0.log").read_text()
    assert not list(fake_docker.glob("*.json"))
    assert any("docker rm --force moriio-e2e-loop-r1-prefill-0" in s for s in said)


def test_the_pull_is_its_own_step_with_progress(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path
) -> None:
    config = loopback_config(tokenizer_json, container__pull="always")
    said: list[str] = []
    report = run(config, tmp_path, SERIES, say=said.append)
    assert report.ok, report.error
    pulls = [s for s in said if s.startswith("[pull @ local]")]
    assert "[pull @ local] 3f1a0c2e: Pulling fs layer" in pulls
    assert pulls[-1].endswith(
        "Downloaded newer image for registry.example.com/overlay:test"
    )
    # One pull per host, before any container starts.
    first_run = next(i for i, s in enumerate(said) if " run --detach" in s)
    assert max(i for i, s in enumerate(said) if s.startswith("[pull")) < first_run


def test_a_pull_that_hangs_stops_at_its_timeout_with_a_report(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_DOCKER_PULL", "hang")
    # The timeout must cover the fake's start and its first lines on a
    # loaded machine (the fake starts without site-packages, conftest), or
    # the hang would be cut before the progress it is to report.
    config = with_timeouts(loopback_config(tokenizer_json), pull_s=PULL_S)
    path = write_config(config, tmp_path / "run.toml")
    run_dir = tmp_path / "run"
    argv = ["e2e", "--config", str(path), "--run-dir", str(run_dir), "--no-preflight"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    report = read_report(run_dir / "report.json")
    assert (
        f"did not finish in {PULL_S:g}s (last output: 3f1a0c2e: Pulling fs layer)"
        in report.error
    )
    assert "[pull @ local] 3f1a0c2e: Pulling fs layer" in out


def test_a_failed_pull_names_the_registry_answer(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_DOCKER_PULL", "fail")
    report = run(loopback_config(tokenizer_json), tmp_path, SERIES, say=lambda _: None)
    assert "pull @ local: exit 1: Error response from daemon: manifest" in report.error


def test_a_whole_run_through_containers_and_the_toy_proxy(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # The front end is the image's toy proxy (here its stand-in), in a
    # container like the servers; it hands the decoder max_tokens - 1.
    config = loopback_config(
        tokenizer_json, 2, 2, kind="toy-proxy", router_container=True,
        router__proxy_ping_port=36367,
    )  # fmt: skip
    discovery = f"127.0.0.1:{config.router.proxy_ping_port}"
    monkeypatch.setenv("STANDIN_DISCOVERY", discovery)
    config = msgspec.structs.replace(
        config,
        router=msgspec.structs.replace(config.router, proxy_ping_port=36367),
    )
    report = run(config, tmp_path, SERIES, say=lambda _: None)
    failures = {
        s.name: [c.detail for c in s.cases if c.status == "fail"][:2]
        for s in report.sections
    }
    assert report.ok, (report.error, failures)
    front = next(s for s in report.sections if s.name == "front end")
    assert front.summary["max_tokens"] == "minus-one"
    assert report.front_end == "toy-proxy"
    assert not list(fake_docker.glob("*.json"))


def test_a_run_whose_preflight_cannot_run_starts_nothing(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # Every real run starts with the preflight: a config with no model
    # config.json for it is refused before any container, unless the run
    # says --no-preflight.
    path = write_config(loopback_config(tokenizer_json), tmp_path / "run.toml")
    run_dir = tmp_path / "run"
    assert main(["e2e", "--config", str(path), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: loop: model.preflight_model is not set")
    assert not run_dir.exists()
    assert not (fake_docker / "calls.jsonl").exists()


def test_a_run_without_the_preflight_says_so_in_its_report(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from vllm_overlay.e2e.cli import series_patches

    found = series_patches()  # the stand-ins carry this checkout's series
    assert found is not None
    monkeypatch.setenv("STANDIN_BANNER", BANNER.replace(SERIES, found[0]))
    path = write_config(loopback_config(tokenizer_json), tmp_path / "run.toml")
    run_dir = tmp_path / "run"
    argv = ["e2e", "--config", str(path), "--run-dir", str(run_dir), "--no-preflight"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "e2e: preflight skipped (--no-preflight)" in out
    md = (run_dir / "report.md").read_text()
    assert "- preflight: skipped (--no-preflight): the config's [layout] is" in md


def test_a_run_the_preflight_could_not_check_starts_nothing(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from vllm_overlay.e2e import cli
    from vllm_overlay.e2e.preflight import Preflight

    blind = Preflight("loop", [], unchecked="vLLM cannot import X here")
    monkeypatch.setattr(cli, "run_preflight", lambda path: blind)
    path = write_config(loopback_config(tokenizer_json), tmp_path / "run.toml")
    run_dir = tmp_path / "run"
    assert main(["e2e", "--config", str(path), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: loop: the preflight could not check the config (vLLM cannot "
        "import X here); nothing was started\n"
    )
    assert not run_dir.exists()
    assert not (fake_docker / "calls.jsonl").exists()
