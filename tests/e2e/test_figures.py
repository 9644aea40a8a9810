"""The report's serving figures and NIC bytes: the load phase's `vllm bench
serve` (its result JSON parsed into TTFT/TPOT/ITL percentiles) and the
decode nodes' `port_rcv_data` deltas (4-byte words) per P/D request, end to
end against the fake engine, and their parts on recorded data."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import (
    BANNER,
    SERIES,
    loopback_config,
    standin_nics,
    write_config,
)
from vllm_overlay.cli import main
from vllm_overlay.e2e.cli import series_patches
from vllm_overlay.e2e.load import BenchResult, bench_argv, cells
from vllm_overlay.e2e.nic import NicCounters, delta_bytes, parse, read_script
from vllm_overlay.e2e.report import read_report
from vllm_overlay.e2e.runid import with_run_id


def test_port_rcv_data_counts_four_byte_words() -> None:
    before = parse("/s/ionic_0/ports/1/counters/port_rcv_data 100\n")
    after = parse(
        "/s/ionic_0/ports/1/counters/port_rcv_data 350\n"
        "/s/ionic_1/ports/1/counters/port_rcv_data 7\n"
        "garbage line\n"
    )
    assert delta_bytes(before, after) == (250 + 7) * 4
    # A counter that went back (reset) counts from zero.
    assert delta_bytes({"a": 500}, {"a": 20}) == 80


def test_the_read_names_the_servers_rdma_devices(tokenizer_json: Path) -> None:
    config = loopback_config(
        tokenizer_json, nic__counters_root="/sys/class/infiniband",
        decode__env={"MORI_RDMA_DEVICES": "ionic_3,ionic_1"},
    )  # fmt: skip
    ran: list[list[str]] = []

    def runner(argv: list[str], timeout_s: float) -> tuple[int, str]:
        ran.append(argv)
        return 0, "/sys/class/infiniband/ionic_1/ports/1/counters/port_rcv_data 9\n"

    counters = NicCounters(config, runner)
    assert counters.read() == {
        "local": {"/sys/class/infiniband/ionic_1/ports/1/counters/port_rcv_data": 9}
    }
    script = ran[0][2]
    assert ran[0][:2] == ["sh", "-c"]
    assert script == read_script("/sys/class/infiniband", ["ionic_1", "ionic_3"])
    assert "/sys/class/infiniband/ionic_1/ports/*/counters/port_rcv_data" in script
    # A node without counters: said once, then not asked again.
    empty = NicCounters(config, lambda argv, t: (0, ""))
    assert empty.read() is None
    assert empty.failed == "local: no RDMA port counters (exit 0)"


def test_the_bench_command_and_its_result(tokenizer_json: Path) -> None:
    config = with_run_id(loopback_config(tokenizer_json), "r1")
    cell = cells(config)[0]
    argv = bench_argv(config, cell, "http://127.0.0.1:9")
    at = argv.index("--entrypoint")
    assert argv[at + 1 : at + 5] == [
        "sh", config.container.image, "-c",
        'vllm "$@" 1>&2 && cat /tmp/bench/result.json',
    ]  # fmt: skip
    assert "--name" in argv and "moriio-e2e-loop-r1-bench-isl64-osl4-c2" in argv
    tail = " ".join(argv[at + 6 :])
    assert tail.startswith("bench serve --backend vllm --base-url http://127.0.0.1:9")
    for part in ("--random-input-len 64", "--random-output-len 4", "--ignore-eos",
                 "--num-prompts 4", "--max-concurrency 2",
                 "--metric-percentiles 50,90,99", "--save-result"):  # fmt: skip
        assert part in tail, part
    # The keys vLLM's benchmarks/serve.py saves (a recorded result).
    saved = {
        "date": "20261203-034500", "backend": "vllm", "completed": 4, "failed": 0,
        "duration": 2.5, "request_throughput": 1.6, "output_throughput": 6.4,
        "mean_ttft_ms": 120.5, "median_ttft_ms": 118.0, "std_ttft_ms": 3.1,
        "p50_ttft_ms": 118.0, "p90_ttft_ms": 125.0, "p99_ttft_ms": 130.2,
        "mean_tpot_ms": 9.5, "p50_tpot_ms": 9.4, "p90_tpot_ms": 9.9,
        "p99_tpot_ms": 10.3, "mean_itl_ms": 9.5, "p50_itl_ms": 9.3,
        "p90_itl_ms": 9.8, "p99_itl_ms": 12.1, "max_concurrency": 2,
    }  # fmt: skip
    result = msgspec.json.decode(json.dumps(saved), type=BenchResult)
    cell.result = result
    assert cell.ok
    assert cell.describe().endswith(
        "TTFT p50/p90/p99 118.0/125.0/130.2 ms, TPOT 9.40/9.90/10.30 ms, "
        "ITL 9.30/9.80/12.10 ms"
    )


def test_a_run_reports_nic_bytes_and_serving_figures(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    found = series_patches()
    assert found is not None
    monkeypatch.setenv("STANDIN_BANNER", BANNER.replace(SERIES, found[0]))
    config = loopback_config(tokenizer_json, **standin_nics(tmp_path, monkeypatch))
    path = write_config(config, tmp_path / "run.toml")
    run_dir = tmp_path / "run"
    argv = ["e2e", "--config", str(path), "--run-dir", str(run_dir), "--no-preflight"]
    code = main(argv)
    out = capsys.readouterr().out
    report = read_report(run_dir / "report.json")
    assert code == 0, (report.error, out[-2000:])
    transfer = next(s for s in report.sections if s.name == "transfer per request")
    # Every P/D request: the NIC received what the decoder loaded (the
    # counter's words x 4), and the first request read a node's counters.
    assert transfer.summary["nic_bytes_total"] == transfer.summary["bytes_total"] > 0
    assert all("NIC received" in c.detail for c in transfer.cases)
    assert report.nic.startswith("port_rcv_data deltas x 4 on the decode nodes")
    # The load phase: one cell, every request completed, percentiles parsed.
    (cell,) = report.load
    assert (cell.input_len, cell.output_len, cell.concurrency) == (64, 4, 2)
    assert cell.ok and cell.result is not None
    r = cell.result
    assert r.completed == 4 and r.p50_ttft_ms > 0 and r.p99_ttft_ms >= r.p50_ttft_ms
    assert r.p99_itl_ms >= r.p50_itl_ms > 0
    load = next(s for s in report.sections if s.name == "serving load")
    assert load.status == "pass"
    md = (run_dir / "report.md").read_text()
    assert "## Serving figures (`vllm bench serve` against the front end)" in md
    assert "| 64/4 | 2 | 4/4 |" in md
    assert not list(fake_docker.glob("*.json"))  # the bench container is gone


def test_the_docs_show_a_complete_report_from_the_fake_engine() -> None:
    # Regenerated by tests/e2e/example_report.py; every section a run
    # reports, the NIC bytes and the serving figures, marked as the fake's.
    from tests.e2e.conftest import REPO
    from tests.e2e.example_report import END, START

    docs = (REPO / "docs" / "e2e.md").read_text()
    block = docs.split(START, 1)[1].split(END, 1)[0]
    assert "**from the fake engine**" in docs.split(START, 1)[0][-600:]
    assert "python -m tests.e2e.example_report docs/e2e.md" in docs
    lines = block.strip().splitlines()
    assert lines[:3] == ["````markdown", "# MoRIIO E2E: PASS", ""]
    assert lines[3] == "> From the fake engine (tests/e2e stand-ins), not hardware."
    names = [
        "launch", "overlay", "front end", "prompt-length sweep",
        "needle in a haystack", "full-local-hit repeat", "prefix-hit transfers",
        "transfer per request", "serving load",
    ]  # fmt: skip
    rows = [x.split(" | ")[0].lstrip("| ") for x in lines if x.endswith("|")]
    assert [n for n in names if n in rows] == names
    assert "- NIC bytes: port_rcv_data deltas x 4 on the decode nodes" in block
    assert "## Serving figures (`vllm bench serve` against the front end)" in block
    assert "nic_bytes_total=" in block and "TTFT p50/p90/p99 ms" in block
