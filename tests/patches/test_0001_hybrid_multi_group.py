"""Patch 0001: MoRIIO hybrid READ for several attention groups (upstream #60867).

The GLM-5.3-Flash-like layout is built BY HAND from real vLLM spec classes,
not through vLLM's planner. On the pinned vLLM 0.33.0 the real GLM5-next
grouping (``get_kv_cache_groups``) gives the kpool tail ring a
``CircularBufferSpec`` and, under block-outermost layouts, wraps the KDA groups
in ``UniformTypeKVCacheSpecs``; #60867's design covers neither (it describes
the tail as a non-prefix-cacheable sliding-window spec and bare KDA
``MambaSpec`` groups); moriio-read-rings-and-wrapped-state-groups adds them
(its tests use the real grouping).
The hand-built layout follows #60867's description:

- MLA + kpool indexer (+ the MTP layer): ``UniformTypeKVCacheSpecs.from_specs``
  over ``MLAAttentionSpec`` layers, block 64, prefix-cacheable;
- the tail ring: ``UniformTypeKVCacheSpecs.from_specs`` over
  ``SlidingWindowMLASpec(bounded_replay=True)`` layers (a sliding-window spec
  that is not prefix-cacheable), block 8, window 8;
- two KDA groups: ``MambaSpec`` with two states, one speculative scratch slot;
- KDA groups ahead of the attention groups in transfer-group order, as vLLM's
  packed grouping emits them, so the payload order is exercised.

Block tables are position-indexed lists built by the tests: a leg holding T
tokens has ``cdiv(T, block)`` pages; sliding-window pages before the window of
the leg's last token are the null block 0; a Mamba table's running-state slot
is followed by its scratch slot. The prefiller holds N-1 prompt tokens plus
one MTP lookahead row, the decoder N tokens plus two rows; prompt lengths are
chosen where both legs hold the same number of pages.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    MoRIIOError,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheGroupSpec
from vllm.v1.request import RequestStatus

from tests.patches.builders import (
    GLM_ATTN,
    GLM_MAMBA,
    GLM_PAYLOAD,
    KDA0_LAYERS,
    KDA1_LAYERS,
    MLA_LAYERS,
    MTP_LAYERS,
    TAIL_B,
    TAIL_LAYERS,
    TAIL_W,
    UNRELATED_ZEROED_BLOCK,
    B,
    attention_read_destinations,
    base_single_group_payload,
    build_worker,
    connector_pair,
    decode_leg,
    full_attention_spec,
    glm_like_groups,
    glm_transfer,
    kda_mamba_spec,
    make_kv_cache_blocks,
    make_kv_cache_config,
    make_request,
    make_scheduler_connector,
    make_vllm_config,
    mla_spec,
    moriio_kv_transfer_config,
    prefill_leg,
    produce,
    read_blocks,
    read_pages,
    reads_by_layer,
    run_transfer,
    single_group_hybrid,
    tail_pages_needed,
    wrapped_window_groups,
)

# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_vllm_configs(llama_model_dir: Path):
    return (
        make_vllm_config(llama_model_dir, moriio_kv_transfer_config("kv_producer")),
        make_vllm_config(llama_model_dir, moriio_kv_transfer_config("kv_consumer")),
    )


# --------------------------------------------------------------------------
# New behaviour (fails on the base)
# --------------------------------------------------------------------------

PROMPT_LENGTHS = (193, 449)  # N - 1 a multiple of B: a full local hit exists


def test_scheduler_accepts_glm_groups_with_mtp(mtp_vllm_configs) -> None:
    groups = glm_like_groups()
    p_conn, d_conn = connector_pair(mtp_vllm_configs, make_kv_cache_config(groups))
    for conn in (p_conn, d_conn):
        sched = conn.connector_scheduler
        assert list(sched._attn_group_ids) == list(GLM_ATTN)
        assert list(sched._mamba_group_ids) == list(GLM_MAMBA)

    n = PROMPT_LENGTHS[0]
    p, params = produce(p_conn, groups, n, "accept")
    payload = params["remote_block_ids"]
    assert len(payload) == len(GLM_PAYLOAD)
    mla_payload, tail_payload, kda0_payload, kda1_payload = payload
    # MLA/indexer: the prompt's pages, in order, from page 0.
    mla_table = p.tables[GLM_ATTN[0]]
    assert mla_payload == mla_table[: len(mla_payload)]
    assert len(mla_payload) >= cdiv(n - 1, B)
    # Tail ring: clipped to its window, cdiv(W, block) + 1 pages, holding the
    # window of the prefiller's last prompt token.
    tail_table = p.tables[GLM_ATTN[1]]
    assert len(tail_payload) == cdiv(TAIL_W, TAIL_B) + 1
    assert any(
        tail_table[start : start + len(tail_payload)] == tail_payload
        for start in range(len(tail_table))
    )
    window_pages = range((n - 1 - TAIL_W) // TAIL_B, (n - 2) // TAIL_B + 1)
    assert set(window_pages) <= {p.page(b) for b in tail_payload if b}
    # KDA: the running-state slot only; the one MTP scratch slot stays local.
    for kda_payload, group_id in ((kda0_payload, 0), (kda1_payload, 2)):
        assert kda_payload == [p.running_slot[group_id]]


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_glm_mtp_read_pairs_every_group_on_partial_hit(mtp_vllm_configs, n) -> None:
    hit_pages = (n - 1) // B - 1
    t = glm_transfer(mtp_vllm_configs, n, hit_pages)
    # MLA/indexer: every prompt page the decoder misses is read in place.
    assert set(range(hit_pages, cdiv(n - 1, B))) <= read_pages(t, 0)
    # Tail ring: the decoder's window pages are read in place.
    assert tail_pages_needed(n) <= read_pages(t, 1)
    # KDA: running-state slot to running-state slot, per group.
    for payload_index, group_id in ((2, GLM_MAMBA[0]), (3, GLM_MAMBA[1])):
        assert t.local[payload_index] == [t.d.running_slot[group_id]]
        assert t.remote[payload_index] == [t.p.running_slot[group_id]]
    # Zeroing: attention READ destinations are kept out; the rest stays.
    read_dst = attention_read_destinations(t, len(GLM_ATTN))
    assert read_dst
    assert sorted(t.zero_after) == sorted(set(t.zero_before) - read_dst)
    for group_id in GLM_MAMBA:  # running-state and scratch slots
        assert set(t.d.tables[group_id][-2:]) <= set(t.zero_after)
    assert UNRELATED_ZEROED_BLOCK in t.zero_after


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_glm_mtp_full_local_hit_reads_only_tail_and_kda(mtp_vllm_configs, n) -> None:
    t = glm_transfer(mtp_vllm_configs, n, (n - 1) // B)
    assert t.local[0] == []  # MLA/indexer: a prefix-cacheable full hit
    if not any(t.local):
        # Nothing external to load: nothing read on either leg.
        assert not any(t.remote)
        return
    assert tail_pages_needed(n) <= read_pages(t, 1)
    for payload_index, group_id in ((2, GLM_MAMBA[0]), (3, GLM_MAMBA[1])):
        # The running-state slots pair, or (the decoder holds the state of a
        # full local hit) neither leg sends one.
        assert (t.local[payload_index], t.remote[payload_index]) in (
            ([t.d.running_slot[group_id]], [t.p.running_slot[group_id]]),
            ([], []),
        )
    tail_dst = {b for b in t.local[1] if b}
    assert tail_dst and not tail_dst & set(t.zero_after)
    assert sorted(t.zero_after) == sorted(set(t.zero_before) - tail_dst)


def test_group_count_mismatch_fails_closed(mtp_vllm_configs) -> None:
    groups = glm_like_groups()
    _, d_conn = connector_pair(mtp_vllm_configs, make_kv_cache_config(groups))
    n = PROMPT_LENGTHS[0]
    p = prefill_leg(groups, n)
    # A prefiller with one attention group fewer: [MLA, KDA0, KDA1].
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "127.0.0.1:1",
        "transfer_id": "t-mismatch",
        "remote_block_ids": [
            p.tables[1],
            [p.running_slot[0]],
            [p.running_slot[2]],
        ],
    }
    d = decode_leg(groups, n, hit_pages=1)
    # With tokens to load (with none, READ reads nothing and pairs nothing).
    num_external = n - 1 - B
    req = make_request(f"mismatch-{num_external}", n, params)
    with pytest.raises(MoRIIOError, match="count mismatch"):
        d_conn.connector_scheduler.update_state_after_alloc(
            req, make_kv_cache_blocks(d.tables), num_external
        )


@pytest.mark.parametrize(
    "attn",
    [
        pytest.param(mla_spec(B), id="mla"),
        pytest.param(full_attention_spec(B), id="gqa"),
    ],
)
def test_single_group_hybrid_accepts_mtp(mtp_vllm_configs, attn) -> None:
    groups = single_group_hybrid(attn, num_mamba=2)
    p_conn, d_conn = connector_pair(mtp_vllm_configs, make_kv_cache_config(groups))
    n = 100
    t = run_transfer(p_conn, d_conn, groups, n, hit_pages=0)
    assert set(range(cdiv(n - 1, B))) <= read_pages(t, 0)
    assert t.local[1:] == [[t.d.running_slot[g]] for g in (1, 2)]
    assert t.remote[1:] == [[t.p.running_slot[g]] for g in (1, 2)]


def test_read_accepts_wrapped_sliding_window_like_bare(plain_vllm_configs) -> None:
    """A UniformTypeKVCacheSpecs over one window is clipped like the bare spec."""
    tables = ([1, 2, 3, 4, 5, 6], [0, 0, 0, 14, 15, 16])
    payloads = []
    for wrapped in (False, True):
        groups = wrapped_window_groups(wrapped)
        p_conn, _ = connector_pair(plain_vllm_configs, make_kv_cache_config(groups))
        req = make_request(
            f"sw-{wrapped}", 96, {"do_remote_decode": True, "transfer_id": "t"}
        )
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = p_conn.request_finished_all_groups(req, tables)
        payloads.append(params["remote_block_ids"])
    assert payloads[1] == payloads[0]
    assert len(payloads[1][1]) == cdiv(64, 16) + 1


# --------------------------------------------------------------------------
# Worker routing, with the mori transfer engine stubbed at its boundary
# --------------------------------------------------------------------------


def test_read_blocks_routes_each_hybrid_layer_to_its_group(
    stub_mori, mtp_vllm_configs
) -> None:
    groups = glm_like_groups()
    kv_cache_config = make_kv_cache_config(groups)
    worker = build_worker(mtp_vllm_configs[1], kv_cache_config)
    try:
        local = [[101, 102], [201, 202], [301], [401]]
        remote = [[111, 112], [211, 212], [311], [411]]
        reads = read_blocks(worker, local, remote, "t-route")
    finally:
        worker.shutdown()

    by_layer = reads_by_layer(reads)
    expected_payload = {
        **{layer: 0 for layer in (*MLA_LAYERS, *MTP_LAYERS)},
        **{layer: 1 for layer in TAIL_LAYERS},
        **{layer: 2 for layer in KDA0_LAYERS},
        **{layer: 3 for layer in KDA1_LAYERS},
    }
    assert set(by_layer) == set(expected_payload)
    for layer, index in expected_payload.items():
        posted = by_layer[layer]
        if index >= 2:  # KDA: conv then ssm region, the group's slot each
            assert [region for region, _, _ in posted] == [0, 1]
        else:
            assert [region for region, _, _ in posted] == [0]
        for _, local_offs, remote_offs in posted:
            assert local_offs == local[index], layer
            assert remote_offs == remote[index], layer


# --------------------------------------------------------------------------
# Back-compat (passes on the base too; not in the patch's Tests header)
# --------------------------------------------------------------------------


SINGLE_GROUP_LAYOUTS = [
    pytest.param((mla_spec(B), 2), id="kimi-k3-like-mla-kda"),
    pytest.param((full_attention_spec(B), 3), id="qwen3.5-like-gqa-gdn"),
]


@pytest.fixture(params=SINGLE_GROUP_LAYOUTS)
def single_group(request: pytest.FixtureRequest, plain_vllm_configs):
    """A single-attention-group hybrid layout (attention spec, number of
    mamba groups): its groups, its mamba group count, both legs' connectors."""
    attn, num_mamba = request.param
    groups = single_group_hybrid(attn, num_mamba)
    p_conn, d_conn = connector_pair(plain_vllm_configs, make_kv_cache_config(groups))
    return groups, num_mamba, p_conn, d_conn


def test_single_attention_group_payload_is_byte_identical_to_base(
    single_group,
) -> None:
    groups, num_mamba, p_conn, _ = single_group
    n = 100  # the prefiller's rows fit its prompt pages
    p, params = produce(p_conn, groups, n, f"bytes-{num_mamba}")
    expected = dict(params)
    expected["remote_block_ids"] = base_single_group_payload(groups, p.tables)
    assert msgspec.msgpack.encode(params) == msgspec.msgpack.encode(expected)
    assert json.dumps(params) == json.dumps(expected)


def test_single_attention_group_read_unchanged(single_group) -> None:
    groups, num_mamba, p_conn, d_conn = single_group
    n = 2 * B + 36
    partial = run_transfer(p_conn, d_conn, groups, n, hit_pages=1)
    assert set(range(1, cdiv(n - 1, B))) <= read_pages(partial, 0)
    mamba_ids = range(1, num_mamba + 1)
    assert partial.local[1:] == [[partial.d.running_slot[g]] for g in mamba_ids]
    assert partial.remote[1:] == [[partial.p.running_slot[g]] for g in mamba_ids]
    assert not attention_read_destinations(partial, 1) & set(partial.zero_after)

    n = 2 * B + 1
    full = run_transfer(p_conn, d_conn, groups, n, hit_pages=2)
    assert full.local[0] == []
    # The running-state slots, or (the decoder holds the state of a full
    # local hit) none.
    assert full.local[1:] in (
        [[full.d.running_slot[g]] for g in mamba_ids],
        [[] for _ in mamba_ids],
    )


def test_single_full_attention_payload_is_byte_identical_to_base(
    plain_vllm_configs,
) -> None:
    """Non-hybrid: the payload is the transfer group's table as allocated."""
    groups = [KVCacheGroupSpec(["attn.0", "attn.1"], full_attention_spec(16))]
    p_conn, _ = connector_pair(plain_vllm_configs, make_kv_cache_config(groups))
    table = [7, 3, 9, 4]
    req = make_request("plain", 60, {"do_remote_decode": True, "transfer_id": "t"})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p_conn.request_finished_all_groups(req, (table,))
    expected = dict(params)
    expected["remote_block_ids"] = [table]
    assert msgspec.msgpack.encode(params) == msgspec.msgpack.encode(expected)


def test_hybrid_without_attention_group_is_rejected(plain_vllm_configs) -> None:
    groups = [KVCacheGroupSpec(["kda.0"], kda_mamba_spec(block_size=B))]
    with pytest.raises(MoRIIOError, match="requires an attention group"):
        connector_pair(plain_vllm_configs, make_kv_cache_config(groups))


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "wrapped"])
def test_write_mode_still_rejects_sliding_window(llama_model_dir, wrapped) -> None:
    # DCP 2: the series later serves WRITE window groups with DCP 1 only.
    config = make_vllm_config(
        llama_model_dir, moriio_kv_transfer_config("kv_producer", read_mode=False)
    )
    config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(NotImplementedError):
        make_scheduler_connector(
            config, make_kv_cache_config(wrapped_window_groups(wrapped))
        )


def test_write_mode_hybrid_still_rejects_other_drafters(deepseek_mtp_model_dir) -> None:
    # n-gram: the series later serves hybrid WRITE with MTP and EAGLE drafters.
    config = make_vllm_config(
        deepseek_mtp_model_dir,
        moriio_kv_transfer_config("kv_producer", read_mode=False),
        block_size=B,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        },
    )
    groups = single_group_hybrid(mla_spec(B), num_mamba=1)
    with pytest.raises(MoRIIOError, match="DSpark.*method='ngram'"):
        make_scheduler_connector(config, make_kv_cache_config(groups))
