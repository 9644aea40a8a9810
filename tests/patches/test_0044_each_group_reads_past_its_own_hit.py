"""Patch 0044: where vLLM states each KV cache group's local prefix hit,
READ reads each group's pages past its own hit.

With divergent local hybrid hits the KV cache manager looks each group up on
its own and the scheduler reports the full-attention group's hit. An EAGLE
drafter owning its group hits a page less (the manager drops its last
matched page): without more, READ gives that group every prompt page.
A window group, looked up on its own too, reads from its window's start.
Where the request states each group's hit (``num_local_hit_tokens_per_group``,
vLLM core patch c005), each group reads only the pages past its own hit. The
hits come from a real ``KVCacheManager``; the request carries them as vLLM's
scheduler records them with c005 (computed from the manager's per-group
lookup where vLLM lacks the field).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.patches.builders import Group, read_after_manager_hit

SHARED_TOKENS = 160  # read_after_manager_hit's cached prefix
BLOCK = 16
WINDOW = 64  # a "window" group's
# A Qwen3.5-EAGLE3-like layout (target, drafter, state), and one whose two
# target groups share a spec, so they are looked up together.
LAYOUTS = {
    "target-drafter-kda": ("target", "drafter", "kda"),
    "two-targets-drafter-kda": ("target", "target", "drafter", "kda"),
    # LFM3-like: a window group, looked up on its own, holds its own hit.
    "target-window-drafter-kda": ("target", "window", "drafter", "kda"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_group_reads_only_the_pages_past_its_own_hit(
    llama_model_dir: Path, layout: str
) -> None:
    """The drafter's group reads from its own hit, a page short of the
    request's; every other attention group from its own hit too."""
    groups = [Group(kind, BLOCK) for kind in LAYOUTS[layout]]
    read = read_after_manager_hit(
        llama_model_dir, groups, BLOCK, divergent=True, stated_group_hits=True
    )
    drafter = LAYOUTS[layout].index("drafter")
    assert read.diverged and read.local_hit == SHARED_TOKENS
    assert read.held[drafter] == SHARED_TOKENS // BLOCK - 1
    for slot, group_index in enumerate(read.attn_group_ids):
        assert read.read[slot] == read.lacking(group_index), f"group {group_index}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_without_stated_hits_groups_read_as_before(
    llama_model_dir: Path, layout: str
) -> None:
    """Guard: a request that does not state each group's hit (vLLM without
    c005) reads as before: the targets' pages past the hit, every prompt
    page of the drafter's group, a window group's pages from its window."""
    kinds = LAYOUTS[layout]
    read = read_after_manager_hit(
        llama_model_dir, [Group(kind, BLOCK) for kind in kinds], BLOCK, divergent=True
    )
    end = -(-(read.num_prompt_tokens - 1) // BLOCK)
    first_page = {
        "drafter": 0,
        "window": (read.num_prompt_tokens - WINDOW) // BLOCK,
    }
    assert read.diverged
    for slot, group_index in enumerate(read.attn_group_ids):
        kind = kinds[group_index]
        expected = (
            read.tables[group_index][first_page[kind] : end]
            if kind in first_page
            else read.lacking(group_index)
        )
        assert read.read[slot] == expected, f"group {group_index}"
