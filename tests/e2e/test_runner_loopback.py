"""A whole harness run on 127.0.0.1: the real vllm-router with the generated
arguments, stand-in P and D servers registered through vLLM's MoRIIO
heartbeat, prompts from a real tokenizer; report and exit status."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import loopback_pair
from tests.e2e.standin import StandIn, greedy
from tests.e2e.tokenizer import build_tokenizer
from vllm_overlay.e2e.config import PairConfig
from vllm_overlay.e2e.plan import build_plan
from vllm_overlay.e2e.report import read_report
from vllm_overlay.e2e.runner import planned_lengths, run

SERIES = "0123abcd4567"
BANNER = f"INFO vllm-moriio-overlay: series {SERIES} (0001-a, 0003-c) on vLLM 0.33.0\n"


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def pair_on_loopback(
    example: PairConfig, tokenizer: Path, p: StandIn, d: StandIn
) -> PairConfig:
    config = loopback_pair(example, health_s=120)
    model = msgspec.structs.replace(
        config.model, tokenizer=str(tokenizer), block_size=64, max_model_len=16384
    )
    checks = msgspec.structs.replace(
        config.checks, needle_words=[300, 2000, 96000], max_tokens=3
    )
    prefill = msgspec.structs.replace(config.prefill, http_port=p.port)
    decode = msgspec.structs.replace(config.decode, http_port=d.port)
    return msgspec.structs.replace(
        config, model=model, checks=checks, prefill=prefill, decode=decode
    )


def start_legs(config: PairConfig, p: StandIn, d: StandIn) -> None:
    proxy = f"tcp://{config.router.address}:{config.router.proxy_ping_port}"
    p.start(proxy, config.prefill.handshake_port, config.prefill.notify_port)
    d.start(proxy, config.decode.handshake_port, config.decode.notify_port + 1)


@pytest.fixture
def legs() -> Iterator[tuple[StandIn, StandIn]]:
    p, d = StandIn("P"), StandIn("D")
    yield p, d
    p.stop()
    d.stop()


def run_on_loopback(
    example: PairConfig,
    tokenizer: Path,
    legs: tuple[StandIn, StandIn],
    run_dir: Path,
) -> tuple[PairConfig, int]:
    p, d = legs
    config = pair_on_loopback(example, tokenizer, p, d)
    start_legs(config, p, d)
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    # What `docker logs` collects from the servers on hardware.
    (logs / "prefill.log").write_text(BANNER)
    (logs / "decode.log").write_text(BANNER)
    plan = build_plan(config).only({"router"})
    report = run(config, run_dir, SERIES, say=lambda _: None, plan=plan)
    return config, 0 if report.ok else 1


def test_matching_answers_pass(
    example_config: PairConfig,
    tokenizer_json: Path,
    legs: tuple[StandIn, StandIn],
    tmp_path: Path,
) -> None:
    config, rc = run_on_loopback(example_config, tokenizer_json, legs, tmp_path)
    report = read_report(tmp_path / "report.json")
    failures = {
        s.name: [c for c in s.cases if c.status == "fail"][:3] for s in report.sections
    }
    assert [s.status for s in report.sections] == ["pass"] * 5, failures
    assert rc == 0
    assert report.image == config.container.image and report.series_id == SERIES
    sweep = report.sections[1]
    assert sweep.summary["prompts"] == len(planned_lengths(config)) >= 100
    needle = report.sections[2]
    assert [c.status for c in needle.cases] == ["pass", "pass", "skip"]
    repeat = report.sections[3]
    assert repeat.cases[-1].detail == "1999 -> 0 tokens"
    p, d = legs
    # Every P/D request reached P as a one-token prefill and D with P's params.
    prefills = [r for r in p.requests if r.get("kv_transfer_params")]
    assert prefills and all(r["max_tokens"] == 1 for r in prefills)
    decodes = [r for r in d.requests if r.get("kv_transfer_params")]
    assert len(decodes) == len(prefills)
    assert (tmp_path / "report.md").read_text().startswith("# MoRIIO E2E: PASS")
    assert b"Add Decode" in (tmp_path / "logs" / "router.log").read_bytes()


def test_a_decoder_mismatch_fails_the_run(
    example_config: PairConfig,
    tokenizer_json: Path,
    tmp_path: Path,
) -> None:
    def wrong_at_447(prompt: list[int]) -> list[int]:
        out = greedy(prompt)
        return [out[0], out[1] + 1, out[2]] if len(prompt) == 447 else out

    p, d = StandIn("P"), StandIn("D", model=wrong_at_447)
    try:
        _, rc = run_on_loopback(example_config, tokenizer_json, (p, d), tmp_path)
    finally:
        p.stop()
        d.stop()
    assert rc == 1
    report = read_report(tmp_path / "report.json")
    sweep = report.sections[1]
    assert sweep.status == "fail"
    assert sweep.summary["failed_lengths"] == "447"
    failed = [c for c in sweep.cases if c.status == "fail"]
    assert [(c.length, c.first_mismatch) for c in failed] == [(447, 1)]
    assert (
        "| kv-447 | 447 | fail | first mismatch at output token 1"
        in (tmp_path / "report.md").read_text()
    )
    assert json.loads((tmp_path / "report.json").read_text())["series_id"] == SERIES
