"""Shared fixtures for the simulator tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.simulate.mixed import MixedPairs
from vllm_overlay import cpuplatform
from vllm_overlay.simulate.plan import PlanItem, base_files
from vllm_overlay.simulate.report import LayoutReport

cpuplatform.use_in_this_process()

SHARED_FIXTURES = ("mixed_pairs", "base_worker_reports")
"""The gate runs the test files using these in one pytest process."""

# What the tests run on the pinned base's moriio files, by test file: one
# worker process (one vLLM import) runs them all, in this order.
BASE_PLANS: dict[str, list[PlanItem]] = {
    # test_base_agrees_with_seeds
    "seeds": [
        PlanItem.of("dsv4", "1-1024", "0"),
        PlanItem.of("kimi", "3001-4096/73", "89.7"),
        PlanItem.of("glm", "100,300", "0,50"),
        PlanItem.of("gemma", "500-620", "0"),
    ],
    # test_shrink: each layout shrunk, then run whole.
    "shrink": [
        PlanItem.of(name, "1-600/7,601-4096/53", "0,50,89.7,100", whole)
        for name in ("dsv4", "gemma")
        for whole in (False, True)
    ],
}


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


@pytest.fixture(scope="session")
def base_worker_reports() -> dict[str, list[LayoutReport]]:
    """The reports of every plan in ``BASE_PLANS``, by name, each in its
    plan's order, from one worker on the pinned base's moriio files."""
    from vllm_overlay.simulate.run import run_variant

    files, _ = base_files()
    plan = [item for items in BASE_PLANS.values() for item in items]
    reports = run_variant("base", files, plan, port=46000)
    assert len(reports) == len(plan), [r.layout for r in reports]
    out: dict[str, list[LayoutReport]] = {}
    for name, items in BASE_PLANS.items():
        out[name], reports = reports[: len(items)], reports[len(items) :]
    return out
