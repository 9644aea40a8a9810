"""Patch 0010: MoRIIO READ keeps its destinations out of KV cache zeroing.

vLLM zeroes freshly allocated blocks when the cache holds Mamba state or
mixes precisions (``KVCacheConfig.needs_kv_cache_zeroing``; e.g. DeepSeek-V4's
fp32 compressor states next to its bf16 attention pages). The scheduler skips
the blocks an asynchronous connector load fills, but MoRIIO READ loads
synchronously, so ``build_connector_meta`` has to drop its READ destinations
from ``new_block_ids_to_zero`` itself, or the zeroing races the RDMA READ.
The tests drive the real scheduler-side connector with position-indexed
tables: page k of a group holds tokens [k*B, (k+1)*B).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)
from vllm.v1.request import RequestStatus

from tests.patches.builders import (
    full_attention_spec,
    make_kv_cache_blocks,
    make_leg_connector,
    make_request,
    make_scheduler_output,
)

B = 64
UNRELATED = 999_999  # a fresh block of another request


def _swa_mla(window: int, dtype: torch.dtype = torch.bfloat16) -> KVCacheSpec:
    return SlidingWindowMLASpec(
        block_size=B,
        num_kv_heads=1,
        head_size=512,
        dtype=dtype,
        sliding_window=window,
    )


def _mla() -> KVCacheSpec:
    return MLAAttentionSpec(
        block_size=B, num_kv_heads=1, head_size=512, dtype=torch.bfloat16
    )


LAYOUTS = {
    # DeepSeek-V4-like: SWA rows, compressed MLA, fp32 compressor states.
    "sw-mla+mla+fp32-state": [
        KVCacheGroupSpec(["swa.0", "swa.1"], _swa_mla(128)),
        KVCacheGroupSpec(["mla.0"], _mla()),
        KVCacheGroupSpec(["state.0"], _swa_mla(8, torch.float32)),
    ],
    "full": [KVCacheGroupSpec(["attn.0", "attn.1"], full_attention_spec(B))],
}

_ids = itertools.count()


def _tables(base: int, groups, num_tokens: int) -> list[list[int]]:
    pages = -(-num_tokens // B)
    return [
        [base + 1000 * g + page for page in range(pages)] for g in range(len(groups))
    ]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("n", [100, 700])
def test_read_destinations_are_not_zeroed(llama_model_dir: Path, layout, n) -> None:
    groups = LAYOUTS[layout]
    p_conn = make_leg_connector(llama_model_dir, "kv_producer", groups)
    d_conn = make_leg_connector(llama_model_dir, "kv_consumer", groups)
    rid = f"zero-{next(_ids)}"
    prefill = make_request(rid, n, {"do_remote_decode": True, "transfer_id": rid})
    prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p_conn.request_finished_all_groups(
        prefill, tuple(_tables(100_000, groups, n))
    )
    assert params is not None
    decode = make_request(rid, n, params)
    external, _ = d_conn.get_num_new_matched_tokens(decode, 0)
    # The decoder's own lookahead page past the prompt is fresh but not read.
    d_tables = _tables(200_000, groups, n + B)
    d_conn.update_state_after_alloc(decode, make_kv_cache_blocks(d_tables), external)
    fresh = [b for table in d_tables for b in table] + [UNRELATED]
    output = make_scheduler_output(fresh)
    meta = d_conn.build_connector_meta(output)
    read = {b for group in meta.reqs_to_recv[rid].local_block_ids for b in group}
    assert read and read <= set(fresh)
    assert set(output.new_block_ids_to_zero) == set(fresh) - read
    assert UNRELATED in output.new_block_ids_to_zero
    assert all(table[-1] in output.new_block_ids_to_zero for table in d_tables)
