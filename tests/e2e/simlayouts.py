"""A simulator worker (``vllm_overlay.simulate.worker``) that also knows the
deployments of the e2e examples the simulator's own layouts do not cover.

``dsv4-both``: the ``dsv4`` mechanism layout (full attention and a 128-token
window, 64-token blocks) with the 9 lookahead slots of MTP x9 on both legs,
as ``examples/dsv4-pro-1p1d.toml`` deploys it (the ``dsv4`` layout gives them
to the decoder only, as the upstream run of vLLM #62165 did).

Run as ``python -m tests.e2e.simlayouts`` with the worker's arguments.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from vllm_overlay.simulate import worker
from vllm_overlay.simulate.layout_types import SpecSlots
from vllm_overlay.simulate.layouts import BASE_LAYOUTS

MTP9 = SpecSlots(num_lookahead_tokens=9)
EXTRA = {
    "dsv4-both": dataclasses.replace(
        BASE_LAYOUTS["dsv4"],
        name="dsv4-both",
        prefill_slots=MTP9,
        decode_slots=MTP9,
        note="full + SW 128, block 64, lookahead 9 on both legs",
    )
}

if __name__ == "__main__":
    BASE_LAYOUTS.update(EXTRA)
    code = worker.main()
    sys.stdout.flush()
    os._exit(code)
