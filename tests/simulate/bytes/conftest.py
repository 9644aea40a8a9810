"""The byte-level tests' zygote: one per pytest process, shared by every test
file here that runs the installed moriio package (vLLM's import, seconds of
CPU, paid once). The gate keeps these files in one process
(`vllm_overlay.gate.shards`, ``SHARED_FIXTURES``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_overlay.simulate.bytes.run import ZygoteSession

SHARED_FIXTURES = ("byte_zygote",)
"""The gate runs the test files using these in one pytest process."""


@pytest.fixture(scope="session")
def byte_zygote() -> Iterator[ZygoteSession]:
    """The installed build's zygote; ``run`` takes the place of
    ``run_zygote("installed", None, ...)``."""
    with ZygoteSession("installed") as zygote:
        yield zygote
