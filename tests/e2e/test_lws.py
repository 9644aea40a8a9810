"""The Kubernetes path: a LeaderWorkerSet per side and the front end, and
the checks against servers started outside the harness (`--launcher attach`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import EXAMPLES, SERIES, loopback_config
from tests.e2e.standin import StandIn
from vllm_overlay.cli import main
from vllm_overlay.e2e.config import load_config
from vllm_overlay.e2e.lws import manifest
from vllm_overlay.e2e.plan import build_plan
from vllm_overlay.e2e.runner import make_launcher, run


def test_manifest_has_a_set_per_side_and_the_front_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = EXAMPLES / "kimi-k3-1p1d.toml"
    assert main(["e2e", "--config", str(path), "--emit", "lws"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == manifest(load_config(path))
    kinds = [(i["kind"], i["metadata"]["name"]) for i in doc["items"]]
    assert kinds == [
        ("Deployment", "kimi-k3-1p1d-router"),
        ("Service", "kimi-k3-1p1d-router"),
        ("LeaderWorkerSet", "kimi-k3-1p1d-prefill"),
        ("LeaderWorkerSet", "kimi-k3-1p1d-decode"),
    ]
    decode = doc["items"][3]
    assert decode["spec"]["replicas"] == 1
    pod = decode["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    assert pod["hostNetwork"] is True
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"amd.com/gpu": 8}
    assert container["command"] == ["vllm"] and container["args"][0] == "serve"
    args = container["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    extra = kv["kv_connector_extra_config"]
    # Kubernetes fills in $(POD_IP) from the pod's env; the servers register
    # with the front end's Service.
    assert extra["host_ip"] == "$(POD_IP)"
    assert extra["proxy_ip"] == "kimi-k3-1p1d-router"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["VLLM_ENGINE_READY_TIMEOUT_S"]["value"] == "3600"
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    probe = container["startupProbe"]
    assert probe["httpGet"] == {"path": "/health", "port": 8200}


def test_attach_checks_servers_it_did_not_start(
    tokenizer_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = loopback_config(tokenizer_json)
    p = StandIn("P", port=config.prefill.instances[0].http_port or 0)
    d = StandIn("D", port=config.decode.instances[0].http_port or 0)
    proxy = f"tcp://127.0.0.1:{config.router.proxy_ping_port}"
    # The front end runs already too (here: the harness's own vllm-router).
    router = make_launcher(
        config, tmp_path / "router", "ssh", lambda _: None,
        build_plan(config).only({"router"}),
    )  # fmt: skip
    try:
        p.start(proxy, 1, 2)
        d.start(proxy, 3, 4)
        with router:
            router.setup()
            report = run(
                config, tmp_path / "run", SERIES, say=print, launcher_kind="attach"
            )
            out = capsys.readouterr().out
    finally:
        p.stop()
        d.stop()
    assert report.ok, report.error
    assert report.launcher == "attach"
    overlay = next(s for s in report.sections if s.name == "overlay")
    assert overlay.status == "skip"
    # Nothing was started or removed by the checks' run.
    assert " run --" not in out and " rm --force" not in out
