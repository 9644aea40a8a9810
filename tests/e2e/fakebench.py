"""A stand-in for `vllm bench serve` (what the fake docker runs for the
load phase's container): the requests of one cell, `--max-concurrency` at a
time, against the front end; prints a result JSON with the keys vLLM's
benchmarks/serve.py saves. The stand-ins do not stream: TTFT is the time to
the whole answer, TPOT and ITL that time over the output tokens (plausible
figures, not a model of vLLM)."""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def main(args: list[str]) -> int:
    assert args[:2] == ["bench", "serve"], args
    url = option(args, "--base-url") + "/v1/completions"
    model = option(args, "--model")
    isl, osl = (
        int(option(args, "--random-input-len")),
        int(option(args, "--random-output-len")),
    )
    n, conc = int(option(args, "--num-prompts")), int(option(args, "--max-concurrency"))
    percentiles = [float(p) for p in option(args, "--metric-percentiles").split(",")]
    rng = random.Random(int(option(args, "--seed")))
    prompts = [[rng.randrange(1, 90) for _ in range(isl)] for _ in range(n)]

    def one(prompt: list[int]) -> tuple[float, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": osl,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        req = urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        start = time.monotonic()
        with urllib.request.urlopen(req, timeout=600) as resp:
            answer = json.loads(resp.read())
        return time.monotonic() - start, int(answer["usage"]["completion_tokens"])

    start = time.monotonic()
    with ThreadPoolExecutor(conc) as pool:
        done = list(pool.map(one, prompts))
    duration = time.monotonic() - start
    print(f"fake bench: {n} requests in {duration:.2f} s", file=sys.stderr)
    ttft = [t * 1000 for t, _ in done]
    tpot = [t * 1000 / max(k, 1) for t, k in done]
    out: dict[str, float | int | str] = {
        "backend": "vllm", "completed": len(done), "failed": 0,
        "duration": duration, "total_input_tokens": isl * n,
        "total_output_tokens": sum(k for _, k in done),
        "request_throughput": len(done) / duration,
        "output_throughput": sum(k for _, k in done) / duration,
        "max_concurrency": conc,
    }  # fmt: skip
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", tpot)):
        out[f"mean_{name}_ms"] = statistics.fmean(values)
        out[f"median_{name}_ms"] = statistics.median(values)
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            out[f"p{word}_{name}_ms"] = percentile(values, p)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
