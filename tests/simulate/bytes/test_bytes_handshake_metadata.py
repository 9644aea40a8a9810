"""The engine core's hand-over of the workers' handshake metadata.

vLLM's engine core collects every worker's ``get_handshake_metadata()`` once
the KV caches are registered and hands it to the scheduler's connector
before it schedules (``driver.Driver.start``, ``rank.Rank.
set_handshake_metadata``). With the series the workers state each group's
least ``tokens_per_state`` there (0054): Qwen4 exp's compressed keys
(``tokens_per_state = 16``) hold no state at N = 2, and their pages move
only when the scheduler heard it from every rank of its leg. Each rank's
model registers Qwen4 exp's QSA ring layers (``QSARawKeyCache``,
``legs.build_ring_layers``), whose group size (16) the workers state there
too (0057): at N = 17 the rings' open group is empty, and their pages move
only when the scheduler heard that from every rank.
"""

from __future__ import annotations

import pytest

from vllm_overlay.simulate.bytes.report import ConfigItem, ConfigReport
from vllm_overlay.simulate.bytes.run import ZygoteSession

ITEMS = [
    ConfigItem("qwen4-exp-mtp", "read", 1, 1, "LBNHC"),
    ConfigItem("qwen4-exp-mtp", "write", 2, 2, "LBNHC"),
]


# N = 2: the compressed keys hold no state (0054); N = 17: the rings' open
# group is empty (0057).
@pytest.fixture(scope="module", params=["2", "17"], ids=["n2", "n17"])
def reports(
    request: pytest.FixtureRequest, byte_zygote: ZygoteSession
) -> dict[ConfigItem, ConfigReport]:
    return {r.item: r for r in byte_zygote.run(ITEMS, request.param, "0")}


@pytest.mark.parametrize("item", ITEMS, ids=lambda i: f"{i.mode}-{i.p_tp}{i.d_tp}")
def test_the_scheduler_hears_its_workers(reports, item):
    report = reports[item]
    assert report.refused_at_start is None and report.first_errors == []
    assert report.cases == report.planned == 1
    assert report.wrong_cases == 0, report.wrong_notes
    assert report.moved_bytes == report.min_bytes > 0
