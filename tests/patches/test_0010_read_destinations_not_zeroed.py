"""Patch 0010: MoRIIO READ keeps its destinations out of KV cache zeroing.

vLLM zeroes freshly allocated blocks when the cache holds Mamba state or
mixes precisions (``KVCacheConfig.needs_kv_cache_zeroing``; e.g. DeepSeek-V4's
fp32 compressor states next to its bf16 attention pages). The scheduler skips
the blocks an asynchronous connector load fills, but a synchronous MoRIIO
READ (where the scheduler recovers a failed synchronous load by request)
needs ``build_connector_meta`` to drop its READ destinations from
``new_block_ids_to_zero`` itself, or the zeroing races the RDMA READ.
The tests drive a real prefill ``Scheduler`` and a real decode ``Scheduler``
through the connector and check the decoder's first step: the pages it READs
are not zeroed, every other fresh page is.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)

from tests.patches.builders import (
    SchedulerPair,
    build_scheduler,
    full_attention_spec,
    make_kv_cache_config,
    make_vllm_config,
    moriio_kv_transfer_config,
    prompt,
)
from tests.patches.vllm_unit_utils import create_scheduler

B = 64
NULL_BLOCK = 0


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


def _pair(model_dir: Path, groups: list[KVCacheGroupSpec]) -> SchedulerPair:
    """A READ prefill leg and a decode leg whose cache is zeroed: mixed
    precisions zero it on their own, and the flag, resolved across workers,
    can come from another worker's layout."""
    prefill = build_scheduler(model_dir, "kv_producer", groups, B, 512)
    vllm_config = make_vllm_config(
        model_dir, moriio_kv_transfer_config("kv_consumer"), block_size=B
    )
    kv_cache_config = make_kv_cache_config(groups, 512)
    kv_cache_config.hash_block_size = B
    kv_cache_config.cache_hit_alignment_tokens = B
    kv_cache_config.needs_kv_cache_zeroing = True
    with set_current_vllm_config(vllm_config):
        decode = create_scheduler(vllm_config, 512, kv_cache_config)
    return SchedulerPair(prefill, decode, B)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("n", [100, 700])
def test_read_destinations_are_not_zeroed(
    llama_model_dir: Path, layout, n, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race needs a synchronous load: a scheduler that recovers a failed
    # synchronous load by request keeps READ synchronous.
    monkeypatch.setattr(Scheduler, "recovers_failed_sync_kv_loads", True, raising=False)
    pair = _pair(llama_model_dir, LAYOUTS[layout])
    rid = f"zero-{next(_ids)}"
    tokens = prompt(next(_ids), n)
    params = pair.prefill_payload(rid, tokens)
    pair.decode.add_request(pair._request(rid, tokens, params))

    output = pair.decode.schedule()

    # An asynchronous load is not computed in the step that allocates it.
    assert output.num_scheduled_tokens.get(rid, 1) == 1
    meta = output.kv_connector_metadata.reqs_to_recv[rid]
    read = {b for group in meta.local_block_ids for b in group}
    tables = pair.decode.kv_cache_manager.get_block_ids(rid)
    fresh = {b for table in tables for b in table if b != NULL_BLOCK}
    assert read and read <= fresh
    assert set(output.new_block_ids_to_zero or ()) == fresh - read
