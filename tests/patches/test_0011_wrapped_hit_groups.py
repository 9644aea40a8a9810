"""Patch 0011: READ's page selection follows the groups vLLM's KV cache
coordinator gives the request's hit, wrapped full attention included.

The coordinator reconciles one hit for every prefix-cacheable group, except
on the per-group lookup it runs for a hybrid READ consumer when a
prefix-cacheable ``FullAttentionSpec`` group exists (the transfer is driven
through the real connector on both legs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.patches.prefix_hit_0005 import Group, TransferCase


@pytest.mark.parametrize("dcp", [1, 4])
def test_wrapped_full_attention_group_reads_only_missing_pages(
    llama_model_dir: Path, dcp: int
):
    """MLA + indexer layers in one ``UniformTypeKVCacheSpecs`` group: no bare
    ``FullAttentionSpec`` group exists, so the coordinator reconciles and the
    wrapped group holds the hit."""
    wrapped = Group("wrapped", 64, dcp_sharded=True)
    page = wrapped.page_tokens(dcp)
    case = TransferCase(
        (wrapped, Group("kda"), Group("kda")), page * 9 + 5, page * 6, dcp=dcp
    )
    assert case.plan(llama_model_dir).pages(0) == case.missing(0)


# Layouts by the attention groups vLLM's KV cache coordinator gives the hit;
# the others can hold less and read every page.
HIT_GROUPS = {
    "wrapped_twice": (
        (Group("wrapped", 64), Group("kda"), Group("wrapped", 64)),
        {0, 2},
    ),
    # The bare MLA group reports its own hit; the wrapped one may hold less.
    "bare_and_wrapped": (
        (Group("target", 64), Group("wrapped", 64), Group("kda")),
        {0},
    ),
    # An EAGLE drafter owning its group: the KV cache manager drops its last
    # matched page.
    "bare_and_drafter": (
        (Group("target", 64), Group("drafter", 64), Group("kda")),
        {0},
    ),
}


@pytest.mark.parametrize("layout", HIT_GROUPS)
def test_hit_groups_follow_the_coordinator(llama_model_dir: Path, layout: str):
    groups, holding = HIT_GROUPS[layout]
    case = TransferCase(groups, 64 * 9 + 5, 64 * 6)
    plan = case.plan(llama_model_dir)
    for index, group in enumerate(groups):
        if group.kind != "kda":
            hit = case.hit_tokens if index in holding else 0
            assert plan.pages(index) == case.missing(index, hit), index
