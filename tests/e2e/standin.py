"""Stand-ins for vLLM servers, on 127.0.0.1: they register with the front
end through vLLM's own MoRIIO heartbeat (its module, run as the process the
connector runs, with the payload the connector builds) and answer /health,
/v1/completions and /metrics like vLLM does, with a deterministic "model" so
P/D and direct answers can be compared.

`python -m tests.e2e.standin serve MODEL --port P --kv-transfer-config J ...`
takes a `vllm serve` command line (what the fake docker runs for the image's
`vllm` entry point); it never imports vLLM, so it starts in a moment.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (prompt ids, max_tokens) -> the answer's ids; a real server with
# ignore_eos answers exactly max_tokens.
Model = Callable[[list[int], int], list[int]]
# What the banner plugin logs in the A/B base image (vllm_overlay/tree/banner.py).
PIN_VERSION = tomllib.loads(
    (Path(__file__).resolve().parents[2] / "pin.toml").read_text()
)["vllm"]["version"]
BASE_LINE = (
    "INFO 12-03 03:00:00 [banner.py:60] vllm-moriio-overlay: no overlay manifest "
    "at /usr/local/lib/python3.12/dist-packages/vllm/distributed/kv_transfer/"
    f"kv_connector/v1/moriio/.overlay-manifest.json; the MoRIIO files are vLLM "
    f"{PIN_VERSION}'s own (base) or unknown"
)
HEARTBEAT_REL = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_heartbeat.py"


def greedy(prompt: list[int], n: int) -> list[int]:
    seed = len(prompt) * 7 + sum(prompt[-8:])
    return [(seed + 13 * i) % 97 for i in range(n)]


def heartbeat_script() -> Path:
    """vLLM's MoRIIO heartbeat module, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / HEARTBEAT_REL


class Heartbeat:
    """vLLM's heartbeat process: the payload on stdin, closing stdin stops it
    (the protocol of MoRIIOHeartbeat)."""

    def __init__(self, endpoint: str, payload: dict[str, Any], interval: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(heartbeat_script()), endpoint, str(interval), "1000"],
            stdin=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(payload) + "\n")
        self.proc.stdin.flush()

    def shutdown(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class StandIn(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        role: str,
        model: Model = greedy,
        port: int = 0,
        wrong: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.role = role  # "P" or "D"
        # Prompt lengths whose KV this decoder reads wrong through P/D (the
        # base image's bugs): its answer then differs from the prefill's.
        self.wrong = wrong
        self.model = model
        self.seen: set[tuple[int, ...]] = set()
        self.external = 0.0
        self.local = 0.0
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.heartbeat: Heartbeat | None = None
        self.log: Callable[[str], None] = lambda _: None

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self, proxy: str, handshake: int, notify: int, dp: int = 1) -> None:
        self.thread.start()
        payload = {
            "type": self.role,
            "http_address": f"127.0.0.1:{self.port}",
            "zmq_address": f"host:127.0.0.1,handshake:{handshake},notify:{notify}",
            "dp_size": dp,
            "tp_size": 1,
            "transfer_mode": "READ",
        }
        self.heartbeat = Heartbeat(proxy, payload, 0.5)

    def stop(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.shutdown()
        self.shutdown()
        self.server_close()

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = [int(t) for t in body["prompt"]]
        params = body.get("kv_transfer_params") or {}
        with self.lock:
            self.requests.append(body)
            if self.role == "D" and "remote_block_ids" in params:
                # Full local hit on a repeat; a shared prefix of earlier
                # prompts in whole 16-token blocks is a partial hit;
                # otherwise all but the last prompt token is loaded.
                hit = max((common_prefix(prompt, s) for s in self.seen), default=0)
                hit = min(hit // 16 * 16, len(prompt) - 1)
                self.local += hit
                self.external += len(prompt) - 1 - hit
                self.seen.add(tuple(prompt))
                nic_received(len(prompt) - 1 - hit)
        self.log(
            f"request role={self.role} prompt_tokens={len(prompt)} "
            f"max_tokens={body.get('max_tokens')} kv={','.join(sorted(params))}"
        )
        tokens = self.model(prompt, int(body.get("max_tokens", 16)))
        if (
            self.role == "D"
            and "remote_block_ids" in params
            and len(prompt) in self.wrong
        ):
            tokens = [(t + 1) % 97 for t in tokens]
        out: dict[str, Any] = {
            "id": "cmpl-standin",
            "object": "text_completion",
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "text": "".join(f" {t}" for t in tokens),
                    "token_ids": tokens,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt) + len(tokens),
            },
        }
        if self.role == "P" and params.get("do_remote_decode"):
            out["kv_transfer_params"] = {
                "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": "standin-p",
                "remote_host": "127.0.0.1",
                "remote_port": 6301,
                "transfer_id": params.get("transfer_id", "t"),
            }
        return out

    def metrics(self) -> str:
        labels = '{engine="0",model_name="standin"}'
        return (
            f"vllm:external_prefix_cache_hits_total{labels} {self.external}\n"
            f"vllm:prefix_cache_hits_total{labels} {self.local}\n"
        )


def nic_received(tokens: int) -> None:
    """The decode node's NIC counter for a READ of ``tokens`` (in 4-byte
    words, as the kernel's port_rcv_data counts): under $STANDIN_NIC_DIR,
    at $STANDIN_NIC_BYTES_PER_TOKEN bytes a token, on the first device of
    the server's MORI_RDMA_DEVICES (default ionic_0)."""
    root = os.environ.get("STANDIN_NIC_DIR", "")
    if not root:
        return
    per_token = int(os.environ.get("STANDIN_NIC_BYTES_PER_TOKEN", "0"))
    device = (os.environ.get("MORI_RDMA_DEVICES") or "ionic_0").split(",")[0]
    counter = Path(root) / device / "ports" / "1" / "counters" / "port_rcv_data"
    counter.parent.mkdir(parents=True, exist_ok=True)
    words = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(f"{words + tokens * per_token // 4}\n")


def common_prefix(a: list[int], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Handler(http.server.BaseHTTPRequestHandler):
    server: StandIn

    def send(self, status: int, data: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's API
        if self.path == "/health":
            self.send(200, b"", "text/plain")
        elif self.path == "/metrics":
            self.send(200, self.server.metrics().encode(), "text/plain")
        else:
            self.send(404, b"", "text/plain")

    def do_POST(self) -> None:  # noqa: N802 - http.server's API
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length))
        data = json.dumps(self.server.answer(body)).encode()
        self.send(200, data, "application/json")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return


def serve_main(argv: list[str]) -> int:
    """A `vllm serve MODEL ...` command line, served by a stand-in until
    SIGTERM. Prints the overlay banner of $STANDIN_BANNER first, and the
    variable named by $STANDIN_LEAK with its value (a server that logs a
    secret)."""
    assert argv[0] == "serve", argv
    port = int(argv[argv.index("--port") + 1])
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = kv["kv_connector_extra_config"]
    dp = (
        int(argv[argv.index("--data-parallel-size") + 1])
        if "--data-parallel-size" in argv
        else 1
    )
    role = "P" if kv["kv_role"] == "kv_producer" else "D"
    banner = os.environ.get("STANDIN_BANNER", "")
    # The A/B base image (its name in $STANDIN_BASE_IMAGE): the banner's
    # base line, and wrong KV at the lengths of $STANDIN_BASE_WRONG.
    base = os.environ.get("STANDIN_IMAGE", "") == os.environ.get(
        "STANDIN_BASE_IMAGE", "\0"
    )
    wrong: frozenset[int] = frozenset()
    if base:
        banner = BASE_LINE
        given = os.environ.get("STANDIN_BASE_WRONG", "")
        wrong = frozenset(int(x) for x in given.split(",") if x)
    if banner:
        print(banner, flush=True)
    leak = os.environ.get("STANDIN_LEAK", "")
    if leak:
        print(f"{leak}={os.environ.get(leak, '')}", flush=True)
    server = StandIn(role, port=port, wrong=wrong)
    server.log = lambda line: print(line, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    endpoint = f"tcp://{extra['proxy_ip']}:{extra['proxy_ping_port']}"
    server.start(endpoint, extra["handshake_port"], extra["notify_port"], dp)
    print(f"stand-in {role} serving on 127.0.0.1:{port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
