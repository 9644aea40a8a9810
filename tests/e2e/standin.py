"""Stand-ins for the two vLLM servers, on 127.0.0.1: they register with the
router through vLLM's own MoRIIO heartbeat (payload as the connector builds
it) and answer /health, /v1/completions and /metrics like vLLM does, with a
deterministic "model" so P/D and direct answers can be compared."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_heartbeat import (
    MoRIIOHeartbeat,
)

Model = Callable[[list[int]], list[int]]


def greedy(prompt: list[int]) -> list[int]:
    return [len(prompt) % 97, sum(prompt) % 89, prompt[-1] % 83]


class StandIn(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, role: str, model: Model = greedy) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.role = role  # "P" or "D"
        self.model = model
        self.seen: set[tuple[int, ...]] = set()
        self.external = 0.0
        self.local = 0.0
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.heartbeat: MoRIIOHeartbeat | None = None

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self, proxy: str, handshake: int, notify: int) -> None:
        self.thread.start()
        payload = {
            "type": self.role,
            "http_address": f"127.0.0.1:{self.port}",
            "zmq_address": f"host:127.0.0.1,handshake:{handshake},notify:{notify}",
            "dp_size": 1,
            "tp_size": 1,
            "transfer_mode": "READ",
        }
        self.heartbeat = MoRIIOHeartbeat(proxy, payload, 0.5, 100)

    def stop(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.shutdown()
        self.shutdown()
        self.server_close()

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = [int(t) for t in body["prompt"]]
        with self.lock:
            self.requests.append(body)
            params = body.get("kv_transfer_params") or {}
            if self.role == "D" and "remote_block_ids" in params:
                # Full local hit on a repeat; otherwise all but the last
                # prompt token is loaded through the connector.
                if tuple(prompt) in self.seen:
                    self.local += len(prompt) - 1
                else:
                    self.external += len(prompt) - 1
                self.seen.add(tuple(prompt))
        tokens = self.model(prompt)[: int(body.get("max_tokens", 16))]
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
            }
        return out

    def metrics(self) -> str:
        labels = '{engine="0",model_name="standin"}'
        return (
            f"vllm:external_prefix_cache_hits_total{labels} {self.external}\n"
            f"vllm:prefix_cache_hits_total{labels} {self.local}\n"
        )


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
