"""The harness's health wait and teardown against a real vllm-router on
127.0.0.1, started with the generated arguments; the P and D servers are
stand-ins that register through vLLM's own MoRIIO heartbeat."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_heartbeat import (
    MoRIIOHeartbeat,
)

from tests.e2e.conftest import LOOPBACK, free_port, loopback_config
from vllm_overlay.e2e.config import RunConfig
from vllm_overlay.e2e.launch import (
    HealthTimeout,
    Launcher,
    LaunchError,
    probe,
    wait_healthy,
)
from vllm_overlay.e2e.plan import Plan, build_plan
from vllm_overlay.e2e.runner import config_endpoints
from vllm_overlay.e2e.servers import router_command, serve_command, servers


def router_plan(config: RunConfig) -> Plan:
    return build_plan(config).only({"router"})


def launcher(config: RunConfig, plan: Plan, log_dir: Path) -> Launcher:
    ends = config_endpoints(config)
    return Launcher(plan, log_dir, ends, poll_s=0.5, say=lambda _: None)


def heartbeat_for(plan_config: RunConfig, role: str) -> MoRIIOHeartbeat:
    """What the server's MoRIIO worker sends, addressed from its generated
    --kv-transfer-config."""
    inner = serve_command(plan_config, servers(plan_config, role)[0])  # type: ignore[arg-type]
    kv = json.loads(inner[inner.index("--kv-transfer-config") + 1])
    extra = kv["kv_connector_extra_config"]
    payload = {
        "type": "P" if kv["kv_role"] == "kv_producer" else "D",
        "http_address": f"{extra['host_ip']}:{extra['http_port']}",
        "zmq_address": (
            f"host:{extra['host_ip']},handshake:{extra['handshake_port']},"
            f"notify:{extra['notify_port']}"
        ),
        "dp_size": 1,
        "tp_size": 1,
        "transfer_mode": "READ" if extra["read_mode"] else "WRITE",
    }
    endpoint = f"tcp://{extra['proxy_ip']}:{extra['proxy_ping_port']}"
    return MoRIIOHeartbeat(endpoint, payload, interval=0.5, max_retries=100)


@pytest.fixture
def heartbeats() -> Iterator[list[MoRIIOHeartbeat]]:
    beats: list[MoRIIOHeartbeat] = []
    yield beats
    for b in beats:
        b.shutdown()


def test_router_args_parse_with_vllm_router(example_config: RunConfig) -> None:
    from vllm_router.launch_router import parse_router_args

    router = msgspec.structs.replace(
        example_config.router, kind="vllm-router", port=30000
    )
    config = msgspec.structs.replace(example_config, router=router)
    args = parse_router_args(router_command(config)[1:])
    args._validate_router_args()
    assert args.vllm_pd_disaggregation is True
    assert args.kv_connector == "moriio"
    assert args.vllm_discovery_address == "0.0.0.0:36367"
    assert args.port == 30000


def test_health_wait_passes_once_both_legs_register(
    tokenizer_json: Path, tmp_path: Path, heartbeats: list[MoRIIOHeartbeat]
) -> None:
    config = loopback_config(tokenizer_json, health_s=120)
    plan = router_plan(config)
    url = f"http://{LOOPBACK}:{config.router.port}/health"
    heartbeats += [heartbeat_for(config, "prefill"), heartbeat_for(config, "decode")]
    with launcher(config, plan, tmp_path) as run:
        run.setup()
        assert url in run.waited
        assert probe(url, 5)[0] == 200
        proc = run.processes["router"]
        assert proc.poll() is None
    assert proc.poll() is not None  # terminated by the teardown
    assert probe(url, 2)[0] == 0  # nothing listens any more
    assert b"Add Decode" in (tmp_path / "router.log").read_bytes()


def test_health_wait_times_out_and_tears_down(
    tokenizer_json: Path, tmp_path: Path, heartbeats: list[MoRIIOHeartbeat]
) -> None:
    # Only the prefill registers: the router stays unhealthy.
    config = loopback_config(tokenizer_json, health_s=4)
    heartbeats.append(heartbeat_for(config, "prefill"))
    run = launcher(config, router_plan(config), tmp_path)
    with pytest.raises(HealthTimeout, match="Waiting for discovered workers"), run:
        run.setup()
    assert run.processes == {}
    assert probe(f"http://{LOOPBACK}:{config.router.port}/liveness", 2)[0] == 0


def test_dead_process_fails_the_wait(tokenizer_json: Path, tmp_path: Path) -> None:
    config = loopback_config(tokenizer_json, health_s=120)
    bad = msgspec.structs.replace(config.router, extra_args=["--no-such-flag"])
    config = msgspec.structs.replace(config, router=bad)
    run = launcher(config, router_plan(config), tmp_path)
    with pytest.raises(LaunchError, match="router @ local process") as info, run:
        run.setup()
    assert "unrecognized arguments: --no-such-flag" in str(info.value)


def test_wait_is_bounded_without_a_server() -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    with pytest.raises(HealthTimeout, match="not healthy after 30s"):
        wait_healthy(
            f"http://{LOOPBACK}:{free_port()}/health", 30, 5,
            clock=lambda: now[0], sleep=sleep,
        )  # fmt: skip
    assert now[0] <= 31


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_tears_down(
    tokenizer_json: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    config = loopback_config(tokenizer_json, health_s=600)
    plan_file = tmp_path / "plan.json"
    plan_file.write_bytes(msgspec.json.encode(router_plan(config)))
    ends = msgspec.json.encode(config_endpoints(config)).decode()
    script = textwrap.dedent(
        f"""
        import signal, sys, msgspec
        from pathlib import Path
        # A shell's background job inherits SIGINT ignored; Python then keeps
        # it ignored. Ctrl-C's default (KeyboardInterrupt) is what is tested.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from vllm_overlay.e2e.launch import Endpoints, Launcher, sigterm_raises
        from vllm_overlay.e2e.plan import Plan
        plan = msgspec.json.decode(Path({str(plan_file)!r}).read_bytes(), type=Plan)
        ends = msgspec.json.decode({ends!r}, type=Endpoints)
        class Spy(Launcher):
            def check_alive(self):
                print("waiting", self.processes["router"].pid, flush=True)
                super().check_alive()
        try:
            say = lambda m: print(m, file=sys.stderr)
            spy = Spy(plan, Path({str(tmp_path)!r}), ends, 0.5, 30, say)
            with sigterm_raises(), spy as l:
                l.setup()
        except BaseException as e:
            print("interrupted:", type(e).__name__, flush=True)
            sys.exit(3)
        """
    )
    harness = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    )
    try:
        # Blocks until the harness is inside the health wait (or has died).
        first = harness.stdout.readline() if harness.stdout else ""
        assert first.startswith("waiting"), first
        router_pid = int(first.split()[1])
        os.kill(router_pid, 0)  # alive
        harness.send_signal(sig)
        out, _ = harness.communicate(timeout=60)
    finally:
        if harness.poll() is None:
            harness.kill()
    assert harness.returncode == 3
    assert "interrupted" in out
    with pytest.raises(ProcessLookupError):
        os.kill(router_pid, 0)


def test_the_servers_health_waits_run_at_once(
    tokenizer_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two servers loading side by side: every round polls both, and one
    # timeout (not one per server) names both when neither answers.
    from vllm_overlay.e2e import launch

    config = loopback_config(tokenizer_json, health_s=1.0)
    plan = build_plan(config).attach()
    plan = Plan(plan.name, plan.image, plan.engine, plan.setup[:2], [], [])
    asked: list[str] = []

    def never(url: str, timeout_s: float) -> tuple[int, str]:
        asked.append(url)
        return 503, "loading"

    monkeypatch.setattr(launch, "probe", never)
    run = Launcher(
        plan, tmp_path, config_endpoints(config), poll_s=0.2, say=lambda _: None
    )
    urls = [s.url for s in plan.setup]
    assert len(urls) == 2 and all(s.action == "wait" for s in plan.setup)
    with pytest.raises(HealthTimeout) as caught:
        run.setup()
    assert sorted(asked[:2]) == sorted(urls)  # the first round asks both
    assert all(f"{u} (HTTP 503: loading)" in str(caught.value) for u in urls)
