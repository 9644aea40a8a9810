"""Shared fixtures for the simulator tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.simulate.mixed import MixedPairs
from vllm_overlay import cpuplatform

cpuplatform.use_in_this_process()

SHARED_FIXTURES = ("mixed_pairs",)
"""The gate runs the test files using these in one pytest process."""


@pytest.fixture(scope="module")
def llama_pair():
    """A real prefill/decode scheduler pair on the installed moriio files."""
    from vllm_overlay.simulate.drive import Pair
    from vllm_overlay.simulate.layouts import expand

    return Pair(expand(["llama"])[0], max_model_len=1024, port=47000)


@pytest.fixture(scope="session")
def mixed_pairs(
    tmp_path_factory: pytest.TempPathFactory, base_texts: dict[str, str]
) -> Iterator[MixedPairs]:
    """This build (the installed moriio files) and the pinned base, paired
    either way: one process imports vLLM, each pair runs forked from it
    (``tests/simulate/mixed.py``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

    overlay = Path(moriio_connector.__file__).parent
    base = tmp_path_factory.mktemp("base") / "moriio"
    base.mkdir(parents=True)
    for path, text in base_texts.items():
        (base / Path(path).name).write_text(text)
    pairs = MixedPairs(overlay, base)
    yield pairs
    pairs.close()
