"""A stand-in for vLLM's MoRIIO toy proxy (what the harness runs by default):
servers register through their MoRIIO heartbeat (msgpack over a zmq ROUTER
socket); a completion goes to a prefill server with max_tokens 1 and the
prefill's KV params go to a decode server, which gets `max_tokens - 1` (the
toy proxy's and vllm-router's READ semantics). Only the decode's answer is
returned.

`python tests/e2e/frontend.py --port P`; the discovery socket binds
$STANDIN_DISCOVERY (host:port), 127.0.0.1:36367 by default.
"""

from __future__ import annotations

import argparse
import http.server
import itertools
import json
import os
import signal
import sys
import threading
import urllib.request
from typing import Any

import msgpack
import zmq


class Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.servers: dict[str, dict[str, dict[str, Any]]] = {"P": {}, "D": {}}
        self.turn = itertools.count()

    def listen(self, address: str) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.bind(f"tcp://{address}")
        except zmq.ZMQError as e:
            print(f"discovery cannot bind {address}: {e}", flush=True)
            os._exit(1)
        while True:
            _, msg = sock.recv_multipart()
            data = msgpack.loads(msg)
            if data.get("type") in ("P", "D"):
                with self.lock:
                    self.servers[data["type"]][data["http_address"]] = data

    def pick(self) -> tuple[str, str] | None:
        with self.lock:
            p, d = sorted(self.servers["P"]), sorted(self.servers["D"])
            if not p or not d:
                return None
            n = next(self.turn)
            return p[n % len(p)], d[n % len(d)]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


class Handler(http.server.BaseHTTPRequestHandler):
    registry: Registry

    def do_POST(self) -> None:  # noqa: N802 - http.server's API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        picked = self.registry.pick()
        if picked is None:
            self.reply(503, b"no prefill or decode registered")
            return
        prefill, decode = picked
        first = dict(body, max_tokens=1, stream=False)
        first["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": "x"}
        kv = post(f"http://{prefill}{self.path}", first)["kv_transfer_params"]
        second = dict(body, max_tokens=int(body["max_tokens"]) - 1)
        second["kv_transfer_params"] = {"do_remote_prefill": True, **kv}
        answer = post(f"http://{decode}{self.path}", second)
        self.reply(200, json.dumps(answer).encode())

    def reply(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    registry = Registry()
    discovery = os.environ.get("STANDIN_DISCOVERY", "127.0.0.1:36367")
    threading.Thread(target=registry.listen, args=(discovery,), daemon=True).start()
    Handler.registry = registry
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(
        f"toy-proxy stand-in on 127.0.0.1:{args.port}, discovery {discovery}",
        flush=True,
    )
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
