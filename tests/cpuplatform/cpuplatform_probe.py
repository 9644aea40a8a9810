"""What vLLM does on the CPU platform it picks in this process, as one JSON line.

``python -m tests.cpuplatform.cpuplatform_probe LAYOUT...`` prints the platform
class vLLM resolved and, per simulator layout (``vllm_overlay.simulate``),
whether a prefill leg builds (a ``VllmConfig`` with MoRIIO READ and the
layout's speculative config, the KV cache planner, a real ``Scheduler``)
and how many tokens that scheduler schedules for one 64-token request; or
the error that stopped it. The platform tests run it in a fresh process
with the environment under test (the platform is chosen once per process).
"""

from __future__ import annotations

import json
import sys
from typing import Any

PROMPT = 64


def probe(name: str, port: int) -> dict[str, Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from vllm_overlay.simulate.layouts import expand
    from vllm_overlay.simulate.legs import build_leg

    layout = expand([name])[0]
    try:
        leg = build_leg(layout, "kv_producer", port, 1024)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    spec = leg.vllm_config.speculative_config
    request = Request(
        "r0",
        list(range(1, PROMPT + 1)),
        SamplingParams(max_tokens=1, ignore_eos=True),
        None,
        block_hasher=leg.block_hasher,
    )
    leg.scheduler.add_request(request)
    out = leg.scheduler.schedule()
    return {
        "connector": leg.vllm_config.kv_transfer_config.kv_connector,
        "speculative": None if spec is None else spec.method,
        "scheduled": out.num_scheduled_tokens.get("r0", 0),
    }


def main(argv: list[str]) -> int:
    import torch  # noqa: F401  (vLLM expects torch imported first)
    from vllm.platforms import current_platform

    cls = type(current_platform)
    result: dict[str, Any] = {"platform": f"{cls.__module__}.{cls.__qualname__}"}
    for i, name in enumerate(argv):
        result[name] = probe(name, 47600 + 10 * i)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
