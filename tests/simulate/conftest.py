"""Shared fixtures for the simulator tests."""

from __future__ import annotations

import pytest

from vllm_overlay import cpuplatform

cpuplatform.use_in_this_process()


@pytest.fixture(scope="module")
def llama_pair():
    """A real prefill/decode scheduler pair on the installed moriio files."""
    from vllm_overlay.simulate.drive import Pair
    from vllm_overlay.simulate.layouts import expand

    return Pair(expand(["llama"])[0], max_model_len=1024, port=47000)
