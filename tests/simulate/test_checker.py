"""The checker on its own: synthetic tables and page stores, no vLLM."""

from vllm_overlay.simulate.check import (
    FULL,
    STATE_KIND,
    WINDOW,
    GroupInfo,
    ReadCheck,
    needs,
    precopy_states,
    sampled_drafter_rows,
)
from vllm_overlay.simulate.pages import PageStore

FULL16 = GroupInfo(FULL, 16, 0, 100)
SW = GroupInfo(WINDOW, 16, 20, 100)
STATE = GroupInfo(STATE_KIND, 16, 0, 1000)


def _computed(store: PageStore, table: list[int], uid: int, n: int, group=0):
    for index, block in enumerate(table):
        lo, hi = index * 16, min(n, (index + 1) * 16)
        if lo < hi:
            store.write_positions(block, group, uid, n, lo, hi)


TABLE = [11, 12, 13]
"""The decoder's block table of the 40-token request."""
READS = [(0, 11), (0, 12), (0, 13)]


def _prefilled() -> PageStore:
    """The prefiller's pages 5, 6, 7 of the 40-token request 1."""
    p = PageStore(0)
    _computed(p, [5, 6, 7], uid=1, n=40)
    return p


def _copy(p: PageStore, d: PageStore, sources: list[int]) -> None:
    """The transfer: prefiller page ``sources[i]`` into ``TABLE[i]``."""
    for src, dst in zip(sources, TABLE, strict=True):
        d.put(dst, p.get(src))


def test_needs_full_window_state():
    assert [(x.index, x.lo, x.hi) for x in needs([FULL16], 33)] == [
        (0, 0, 16),
        (1, 16, 32),
    ]
    # A window of 20 for position 40 needs positions [21, 40).
    assert [(x.index, x.lo, x.hi) for x in needs([SW], 41)] == [
        (1, 21, 32),
        (2, 32, 40),
    ]
    # The state after 32 tokens, in the block the step for position 32 uses.
    assert [(x.index, x.lo) for x in needs([STATE], 33)] == [(2, 32)]
    assert needs([FULL16, SW, STATE], 1) == []


def test_exact_read_is_right_and_minimal():
    p, d = _prefilled(), PageStore(0)
    check = ReadCheck([FULL16], [TABLE], d, 40, uid=1)
    _copy(p, d, [5, 6, 7])
    result = check.judge(d, READS, 0.0, 0)
    assert not result.wrong
    assert (result.pages_read, result.min_pages) == (3, 3)
    assert result.extra_reads == result.duplicate_reads == result.unread == 0


def test_shifted_pairing_is_wrong_kv():
    p, d = _prefilled(), PageStore(0)
    check = ReadCheck([FULL16], [TABLE], d, 40, uid=1)
    _copy(p, d, [6, 7, 5])
    result = check.judge(d, READS, 0.0, 0)
    assert result.wrong and result.wrong_groups == [0]


def test_reading_a_cached_page_raises_the_byte_ratio():
    p, d = _prefilled(), PageStore(0)
    _computed(d, [11], uid=1, n=40)  # the decoder's own prefix hit
    check = ReadCheck([FULL16], [TABLE], d, 40, uid=1)
    _copy(p, d, [5, 6, 7])
    result = check.judge(d, READS, 0.5, 16)
    assert not result.wrong
    assert (result.min_pages, result.min_bytes) == (2, 200)
    assert (result.pages_read, result.bytes_read) == (3, 300)
    assert result.extra_reads == 1


def test_a_page_past_the_local_hit_is_lacked_whatever_it_holds():
    """A freed block the decoder reallocates can still hold the same prompt's
    KV (a warm-up's partial tail page); past the local hit the load must
    fill it all the same."""
    d = PageStore(0)
    _computed(d, TABLE, uid=1, n=40)  # stale pages of an identical prompt
    assert ReadCheck([FULL16], [TABLE], d, 40, uid=1).lacked == set()
    check = ReadCheck([FULL16], [TABLE], d, 40, uid=1, computed_tokens=32)
    assert check.lacked == {(0, 13)}
    result = check.judge(d, [(0, 13)], 1.0, 32)
    assert not result.wrong and (result.pages_read, result.min_pages) == (1, 1)
    # The state after 39 tokens: lacked unless the decoder computed them.
    state_table = [0, 0, 31]
    d.write_state(31, 0, 1, 40, 39)
    assert ReadCheck([STATE], [state_table], d, 40, 1, 39).lacked == set()
    assert ReadCheck([STATE], [state_table], d, 40, 1, 32).lacked == {(0, 31)}


def test_duplicate_and_unread_pages_count():
    p, d = _prefilled(), PageStore(0)
    check = ReadCheck([FULL16], [TABLE], d, 40, uid=1)
    d.put(11, p.get(5))
    d.put(12, p.get(6))
    d.put(12, p.get(6))
    result = check.judge(d, [(0, 11), (0, 12), (0, 12)], 0.0, 0)
    assert result.wrong
    assert (result.duplicate_reads, result.unread) == (1, 1)


def test_freed_or_reused_block_holds_nothing_of_the_request():
    p = _prefilled()
    p.write_positions(6, 0, 2, 40, 0, 16)  # block 6 reused by another prompt
    d = PageStore(0)
    check = ReadCheck([FULL16], [TABLE], d, 40, uid=1)
    _copy(p, d, [5, 6, 7])
    assert check.judge(d, READS, 0.0, 0).wrong
    # The null block never holds anything.
    p.write_positions(0, 0, 1, 40, 0, 16)
    assert p.get(0) is None


def test_state_precopy_uses_the_pre_read_contents():
    d = PageStore(0)
    # 33 tokens: the step for position 32 runs on block index 2; the worker
    # first copies index 1 into it.
    table = [0, 21, 22]
    d.write_state(21, 0, 1, 33, 32)
    precopy_states([STATE], [table], d, 33)
    check = ReadCheck([STATE], [table], d, 33, uid=1)
    result = check.judge(d, [], 1.0, 32)
    assert not result.wrong and result.min_pages == 0


def test_asynchronous_load_of_a_state_is_judged_on_the_computing_step_table():
    """33 tokens, loaded asynchronously: the allocation's table ends at the
    32 tokens loaded (index 1 holds the state after them); the computing
    step's table adds index 2, which the worker's copy fills from index 1."""
    p, d = PageStore(0), PageStore(0)
    p.write_state(7, 0, 1, 33, 32)
    allocated = [0, 21]
    check = ReadCheck([STATE], [allocated], d, 33, 1, 0, load_before_copy=True)
    assert check.lacked == {(0, 21)}
    d.put(21, p.get(7))  # the READ
    computing = [0, 21, 22]
    precopy_states([STATE], [computing], d, 33)
    check.tables = [computing]
    result = check.judge(d, [(0, 21)], 0.0, 0)
    assert not result.wrong
    assert (result.pages_read, result.min_pages, result.unread) == (1, 1, 0)
    # The state read into the block the copy overwrites is lost.
    d = PageStore(0)
    check = ReadCheck([STATE], [allocated], d, 33, 1, 0, load_before_copy=True)
    d.put(22, p.get(7))
    precopy_states([STATE], [computing], d, 33)
    check.tables = [computing]
    result = check.judge(d, [(0, 22)], 0.0, 0)
    assert result.wrong and result.unread == 1


def test_compressed_cache_needs_only_complete_groups():
    from vllm_overlay.simulate.check import GroupInfo as G

    compressed = G(FULL, 16, 0, 100, tokens_per_state=4)
    # Position 38 is computed by the decoder; groups [0, 36) are complete.
    assert [(x.index, x.lo, x.hi) for x in needs([compressed], 39)] == [
        (0, 0, 16),
        (1, 16, 32),
        (2, 32, 36),
    ]
    # Nothing complete below position 3.
    assert needs([compressed], 4) == []


def test_chunked_local_attention_needs_the_current_chunk():
    from vllm_overlay.simulate.check import CHUNK

    chunk = GroupInfo(CHUNK, 16, 32, 100)
    # Position 40 attends to its chunk [32, 40).
    assert [(x.index, x.lo, x.hi) for x in needs([chunk], 41)] == [(2, 32, 40)]
    # The first position of a chunk attends to no earlier one.
    assert needs([chunk], 33) == []


def test_ring_needs_the_open_group_rows_in_its_one_block():
    from vllm_overlay.simulate.check import RING

    ring = GroupInfo(RING, 32, 16, 100, ring_capacity=32)
    assert [(x.index, x.lo, x.hi) for x in needs([ring], 41)] == [(0, 32, 40)]
    assert needs([ring], 33) == []  # the group of position 32 opens with it


def test_ring_page_keeps_the_latest_capacity_rows():
    from vllm_overlay.simulate.check import RING

    ring = GroupInfo(RING, 8, 4, 100, ring_capacity=8)
    p = PageStore(0)
    p.write_ring(5, 0, 1, 50, 0, 30, 8)  # a prefill chunk: rows 22..29 stay
    p.write_ring(5, 0, 1, 50, 30, 38, 8)  # the next chunk overwrites them
    assert p.get(5)[3:] == (30, 38)
    d = PageStore(0)
    check = ReadCheck([ring], [[9]], d, 39, uid=1)
    assert check.lacked == {(0, 9)}
    d.put(9, p.get(5))
    assert not check.judge(d, [(0, 9)], 0.0, 0).wrong
    # A ring of the same request whose rows stop short of position 38 is wrong.
    d.put(9, None)
    p.write_ring(6, 0, 1, 50, 0, 37, 8)
    d.put(9, p.get(6))
    assert check.judge(d, [(0, 9)], 0.0, 0).wrong


def test_local_only_group_needs_nothing():
    from vllm_overlay.simulate.check import LOCAL_ONLY

    assert needs([GroupInfo(LOCAL_ONLY, 16, 0, 100)], 100) == []


def test_a_null_block_pair_is_wrong_even_off_the_needed_positions():
    p, d = PageStore(0), PageStore(0)
    _computed(p, [5, 6, 7], uid=1, n=40)
    table = [11, 12, 13]
    check = ReadCheck([FULL16], [table], d, 40, uid=1)
    for src, dst in zip([5, 6, 7], table, strict=True):
        d.put(dst, p.get(src))
    reads = [(0, 11), (0, 12), (0, 13)]
    assert not check.judge(d, reads, 0.0, 0).wrong
    # One more pair, null block to null block: no needed position changes.
    d.put(0, p.get(0))
    result = check.judge(d, [*reads, (0, 0)], 0.0, 0, null_reads=[0])
    assert result.wrong and result.wrong_groups == [0]
    assert result.null_reads == 1 and result.unread == 0


def test_past_hit_is_the_rule_both_simulators_share():
    """``past_hit``: an attention page whose positions end past the local
    hit, or a state after more tokens than it; unknown hit: never."""
    from vllm_overlay.simulate.check import past_hit

    page0, page1 = needs([FULL16], 33)
    assert not past_hit(page0, 16) and past_hit(page1, 16)
    assert not past_hit(page1, 32)
    (state,) = needs([STATE], 40)
    assert past_hit(state, 38) and not past_hit(state, 39)
    assert not past_hit(page1, None) and not past_hit(state, None)


def test_sampled_drafter_rows_counts_the_row_before_the_first_uncomputed_token():
    """A drafter's row of p reads token p + 1: with N - 1 tokens prefilled,
    the row of N - 2 took the prefiller's sample; one per drafter layer whose
    page holding it was read, none when that page was not read or every
    token was prefilled."""
    rows = sampled_drafter_rows
    groups = [
        GroupInfo(FULL, 16, 0, 1, draft_layers=2),
        GroupInfo(FULL, 16, 0, 1),
        GroupInfo(STATE_KIND, 16, 0, 1, draft_layers=1),
    ]
    tables = [[10, 11, 12], [20, 21, 22], [30]]
    n = 40  # the row of 38 lives in block 2
    read_all = [(0, 12), (1, 22), (2, 30)]
    assert rows(groups, tables, read_all, n, prefilled=n - 1) == 2
    assert rows(groups, tables, read_all, n, prefilled=n) == 0
    assert rows(groups, tables, [(0, 11), (1, 22)], n, prefilled=n - 1) == 0
    # A longer back-off puts the sampled row in an earlier block.
    assert rows(groups, tables, [(0, 11)], n, prefilled=30) == 2
