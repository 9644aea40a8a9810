"""Ctrl-C (SIGINT to the terminal's process group) and a SIGTERM to nox
alone, under `nox -s e2e` (this checkout's noxfile, nox's own signal
handling), against the fake engine: every container of the run is removed,
and a colleague's container of the same config on the same node is not.
`e2e --reap` removes the stale containers of one's own earlier runs only."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import REPO, loopback_config, shim_path, write_config
from vllm_overlay.cli import main
from vllm_overlay.e2e.config import RunConfig
from vllm_overlay.e2e.runid import (
    LABEL_NAME,
    LABEL_OWNER,
    LABEL_RUN,
    run_prefix,
    with_run_id,
)
from vllm_overlay.e2e.servers import container_name

# Generous: a loaded machine is slow, and nothing here waits on a clock
# except to give up.
GIVE_UP_S = 300.0
SERVERS = ("prefill-0", "decode-0")


def nox_program() -> str:
    nox = shutil.which("nox")
    if nox is None:
        pytest.skip("nox is not installed here (ci/requirements-nox.txt)")
    return nox


@pytest.fixture
def overlay_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm-overlay` on PATH: this checkout, in this Python (what nox's
    session runs under `--force-venv-backend none`)."""
    command = f"PYTHONPATH={REPO} exec {sys.executable} -m vllm_overlay.cli"
    path = shim_path(tmp_path / "overlay-bin", "vllm-overlay", command)
    monkeypatch.setenv("PATH", path)


def start_foreign(config: RunConfig, run_id: str, who: str, what: str) -> str:
    """A container of another run of ``config`` (``who``'s) through the fake
    docker: still loading (FAKE_DOCKER_LOADING matches its run id)."""
    other = with_run_id(config, run_id)
    name = container_name(other, what)
    argv = [
        "docker", "run", "--detach", "--name", name,
        "--label", f"{LABEL_RUN}={run_id}",
        "--label", f"{LABEL_NAME}={run_prefix(config)}",
        "--label", f"{LABEL_OWNER}={who}",
        "--entrypoint", "vllm", config.container.image, "serve", "/models/x",
    ]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, timeout=GIVE_UP_S)
    return name


def running(state: Path) -> set[str]:
    return {p.stem for p in state.glob("*.json")}


class Lines:
    """A process's output lines, read as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        assert proc.stdout is not None
        out = proc.stdout

        def pump() -> None:
            for line in out:
                self._q.put(line.rstrip("\n"))
            self._q.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def until(self, marker: str) -> bool:
        deadline = time.monotonic() + GIVE_UP_S
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                return False
            self.seen.append(line)
            if marker in line:
                return True
        return False

    def rest(self) -> str:
        self.until("\0never")
        return "\n".join(self.seen)


def _as_from_a_terminal() -> None:
    """SIGINT and SIGQUIT as a terminal's foreground job has them. A shell
    starts a background job with both ignored, and an ignored signal stays
    ignored across exec (Python then installs no KeyboardInterrupt handler),
    so a suite run from a background job would test a nox that cannot be
    interrupted."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm-to-nox"])
def test_an_interrupted_nox_run_removes_its_containers_only(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, overlay_on_path: None, how: str,
) -> None:  # fmt: skip
    nox = nox_program()
    # decode-0 never serves: the run sits in its health wait (an hour)
    # with every container started, until the signal.
    monkeypatch.setenv("FAKE_DOCKER_LOADING", "decode-0,colleague")
    config = loopback_config(tokenizer_json, health_s=3600)
    theirs = start_foreign(config, "colleague1", "someone-else", "prefill-0")
    path = write_config(config, tmp_path / "run.toml")
    run_dir = tmp_path / "run"
    argv = [
        nox, "-f", str(REPO / "noxfile.py"), "--force-venv-backend", "none",
        "--envdir", str(tmp_path / "nox-envs"), "-s", "e2e", "--",
        "--config", str(path), "--run-dir", str(run_dir), "--no-preflight",
        "--run-id", "mine1",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own group: the "terminal" Ctrl-C hits
        preexec_fn=_as_from_a_terminal,
    )  # fmt: skip
    lines = Lines(proc)
    try:
        decode_url = servers_url(config, "decode")
        waiting = lines.until(f"wait for GET {decode_url}/health")
        assert waiting, "\n".join(lines.seen[-30:])
        ours = {container_name(with_run_id(config, "mine1"), w) for w in (
            "prefill-0", "decode-0")}  # fmt: skip
        assert ours <= running(fake_docker), running(fake_docker)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        out = lines.rest()
        proc.wait(timeout=GIVE_UP_S)
    finally:
        # nox and whatever of its group is left (a harness nox left behind).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "removing every container first" in out, out[-3000:]
    assert running(fake_docker) == {theirs}, out[-3000:]
    assert "Traceback" not in out


def servers_url(config: RunConfig, role: str) -> str:
    from vllm_overlay.e2e.servers import servers

    return next(s.url for s in servers(config) if s.role == role)


def test_reap_removes_stale_containers_of_ones_own_runs_only(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from vllm_overlay.e2e.runid import owner

    monkeypatch.setenv("FAKE_DOCKER_LOADING", "old,colleague,other")
    config = loopback_config(tokenizer_json)
    mine = [
        start_foreign(config, "old1", owner(), w) for w in ("prefill-0", "decode-0")
    ]
    theirs = start_foreign(config, "colleague1", "someone-else", "prefill-0")
    # Our own container of another config is not this config's to reap.
    renamed = msgspec.structs.replace(config, name="other")
    elsewhere = start_foreign(renamed, "old2", owner(), "prefill-0")
    path = write_config(config, tmp_path / "run.toml")
    assert main(["e2e", "--config", str(path), "--reap"]) == 0
    out = capsys.readouterr().out
    assert running(fake_docker) == {theirs, elsewhere}
    for name in mine:
        assert f"[reap @ local] docker rm --force {name}" in out
    assert out.splitlines()[-1] == (
        f"e2e reap loop: 2 stale containers of {owner()}'s runs "
        "(moriio-e2e-loop-*) removed"
    )
