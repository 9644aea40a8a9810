"""The simulator's own checks, on real schedulers (installed moriio files).

Full-attention Llama-like READ is right on the base and on the overlay, so
these tests hold for either; they prove the checker sees what it must.
"""

from __future__ import annotations

import pytest


def _shift_by_one_page(local, remote, tables):
    del tables
    return local, [r[1:] + r[:1] for r in remote]


def test_correct_read_is_not_wrong_kv(llama_pair):
    result = llama_pair.run_case(100, 0.0)
    assert result.error is None
    assert not result.wrong
    assert result.pages_read == result.min_pages == 7


def test_shifted_pairing_is_reported_as_wrong_kv(llama_pair):
    result = llama_pair.run_case(100, 0.0, rewrite=_shift_by_one_page)
    assert result.error is None
    assert result.wrong and result.wrong_groups == [0]


def test_read_of_an_already_cached_page_shows_in_the_bytes(llama_pair):
    # 50 % hit on 200 tokens: the decoder caches pages 0..5 itself.
    plain = llama_pair.run_case(200, 0.5)

    def also_read_cached_page(local, remote, tables):
        # Add one pair whose destination is the decoder's cached page 0 and
        # whose source is the prefiller's page 0 (held until READ completes).
        prefill = llama_pair.p.scheduler.kv_cache_manager.get_block_ids(
            f"r{llama_pair._seq}"
        )
        return [[tables[0][0], *local[0]]], [[prefill[0][0], *remote[0]]]

    extra = llama_pair.run_case(200, 0.5, rewrite=also_read_cached_page)
    assert plain.error is None and extra.error is None
    assert not extra.wrong
    assert extra.local_hit_tokens == plain.local_hit_tokens > 0
    assert extra.min_bytes == plain.min_bytes
    assert extra.bytes_read == plain.bytes_read + extra.bytes_read // extra.pages_read
    assert extra.extra_reads == plain.extra_reads + 1
    assert extra.bytes_read / extra.min_bytes > plain.bytes_read / plain.min_bytes


def test_a_read_from_the_null_block_is_wrong_kv(llama_pair):
    """A pair with the null block on both sides lands on no position the last
    token needs, and is still reported."""
    null_p = llama_pair.p_store.null_block_id
    null_d = llama_pair.d_store.null_block_id

    def add_null_pair(local, remote, tables):
        del tables
        return [[*local[0], null_d]], [[*remote[0], null_p]]

    plain = llama_pair.run_case(100, 0.0)
    result = llama_pair.run_case(100, 0.0, rewrite=add_null_pair)
    assert plain.error is None and result.error is None
    assert not plain.wrong and plain.null_reads == 0
    assert result.wrong and result.wrong_groups == [0]
    assert result.null_reads == 1 and result.unread == 0


def test_a_read_without_external_tokens_lands_after_the_forward(llama_pair):
    """A full local hit loads nothing: vLLM marks no synchronous load, so the
    model runner starts any READ after the forward. A READ posted then is
    wrong KV (it overwrites what the forward wrote, in blocks the finished
    request may have freed), whatever it copies."""
    plain = llama_pair.run_case(65, 1.0)
    assert plain.error is None and not plain.wrong
    assert plain.local_hit_tokens == 64 and plain.late_reads == 0

    def read_a_held_page(local, remote, tables):
        prefill = llama_pair.p.scheduler.kv_cache_manager.get_block_ids(
            f"r{llama_pair._seq}"
        )
        return [[tables[0][0]]], [[prefill[0][0]]]

    late = llama_pair.run_case(65, 1.0, rewrite=read_a_held_page)
    assert late.error is None
    assert late.wrong and late.wrong_groups == [0]
    assert late.late_reads == 1


@pytest.mark.parametrize("layout", ["lfm3", "zaya"])
@pytest.mark.parametrize("n", [17, 129])
def test_state_read_on_a_block_boundary_is_judged_where_it_is_computed(layout, n):
    """N - 1 a multiple of the state group's block size: a decoder that
    loads asynchronously allocates the N - 1 tokens it loads (the state in
    their last block) and adds the block of position N - 1 when it computes
    it, copied from the one before. The READ is judged on that table."""
    from vllm_overlay.simulate.drive import Pair
    from vllm_overlay.simulate.layouts import expand

    pair = Pair(expand([layout])[0], max_model_len=256, port=47200)
    state = [g for g, info in enumerate(pair.groups) if info.kind == "state"]
    assert state and all(pair.groups[g].block_tokens == 16 for g in state)
    result = pair.run_case(n, 0.0)
    assert result.error is None and not result.fallback
    assert not result.wrong, result.wrong_groups
    assert result.unread == 0
