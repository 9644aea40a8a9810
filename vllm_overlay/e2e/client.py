"""HTTP to the servers: greedy completions by token ids, Prometheus counters."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import msgspec

# Decoder counters, in tokens: loaded through the connector / hit locally.
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
LOCAL_HITS = "vllm:prefix_cache_hits"


class Completion(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: list[int]
    text: str
    prompt_tokens: int
    finish_reason: str = ""
    error: str = ""


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def complete(
    base_url: str,
    model: str,
    prompt_ids: list[int],
    max_tokens: int,
    timeout_s: float,
    ignore_eos: bool = False,
    stop: list[str] | None = None,
) -> Completion:
    """One greedy completion; errors are recorded, not raised."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "return_token_ids": True,
    }
    if stop:
        body["stop"] = stop
    try:
        data = post_json(f"{base_url}/v1/completions", body, timeout_s)
    except urllib.error.HTTPError as e:
        detail = e.read(300).decode(errors="replace")
        return Completion([], "", 0, error=f"HTTP {e.code}: {detail}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        return Completion([], "", 0, error=f"{type(e).__name__}: {e}")
    return parse_completion(data)


def parse_completion(data: dict[str, Any]) -> Completion:
    try:
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        token_ids = choice.get("token_ids")
        if token_ids is None:
            return Completion(
                [], choice.get("text", ""), 0, error="answer carries no token_ids"
            )
        return Completion(
            [int(t) for t in token_ids],
            str(choice.get("text", "")),
            int(usage.get("prompt_tokens", 0)),
            str(choice.get("finish_reason") or ""),
        )
    except (KeyError, IndexError, TypeError, ValueError) as e:
        return Completion([], "", 0, error=f"malformed answer: {e!r}")


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each counter over all its label sets (``name`` or
    ``name_total``), from Prometheus text exposition."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        metric = m.group(1).removesuffix("_total")
        if metric in out:
            try:
                out[metric] += float(m.group(3))
            except ValueError:
                continue
    return out


def scrape(base_url: str, timeout_s: float) -> dict[str, float] | None:
    """A decoder's cache counters; None when /metrics cannot be read."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as r:
            text = r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None
    return parse_counters(text, (EXTERNAL_HITS, LOCAL_HITS))


def scrape_all(base_urls: list[str], timeout_s: float) -> dict[str, float] | None:
    """The counters summed over every decoder; None if one cannot be read."""
    total = dict.fromkeys((EXTERNAL_HITS, LOCAL_HITS), 0.0)
    for url in base_urls:
        one = scrape(url, timeout_s)
        if one is None:
            return None
        for k, v in one.items():
            total[k] += v
    return total
