"""Patch 0050: hybrid READ skips the decoder's local hit only in the groups
that hold it.

The scheduler reports one local prefix hit. Which transfer groups hold it
depends on how vLLM's KV cache manager looked them up, so the page
selection asks one function (``_local_hit_group_ids``) and reads every
prompt page of a full-attention group outside it: such a group may lack
pages the reported hit covers. The transfers run through the real
scheduler-side connector on both legs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

from tests.patches.builders import Group, TransferCase

TARGETS_KDA = (Group("target", 64), Group("target", 64), Group("kda"))
CASE = TransferCase(TARGETS_KDA, 64 * 10 + 9, 64 * 6)


@pytest.mark.parametrize(
    "held", [(), (0,), (1,), (0, 1)], ids=["none", "first", "second", "both"]
)
def test_a_group_not_holding_the_hit_reads_every_prompt_page(
    llama_model_dir: Path, monkeypatch: pytest.MonkeyPatch, held: tuple[int, ...]
) -> None:
    """A group the function names reads only the pages past the hit; any
    other full-attention group reads every prompt page."""

    def local_hit_group_ids(*args: Any, **kwargs: Any) -> frozenset[int]:
        return frozenset(held)

    monkeypatch.setattr(moriio_connector, "_local_hit_group_ids", local_hit_group_ids)
    plan = CASE.plan(llama_model_dir)
    for group in (0, 1):
        expected = CASE.missing(group) if group in held else CASE.missing(group, 0)
        assert plan.pages(group) == expected, f"group {group}"
