"""Patch 0009: MoRIIO READ of GLM-5.3-Flash's real grouping on vLLM 0.33.0.

The per-layer specs follow 0.33.0's GLM5-next code (vllm/models/glm5next):
KDA layers (``MambaSpec``, one scratch slot per speculative token, the page
padded to the attention page), indexed-attention layers with MLA (a 512
latent), the kpool indexer key cache (``tokens_per_state = index_kpool``,
16) and the kpool tail ring (``CircularBufferSpec``, one block of
``16 * pow2(cdiv(16 + num_spec, 16))`` rows per request); the MTP layer is an
indexed-attention layer marked as a draft. Block 640, as
``Platform._align_hybrid_block_size`` resolves it for these shapes at TP 8.

vLLM's own planner (``get_kv_cache_groups``) groups them. Their pages
differ, so layer-outermost layouts cannot group them at all and
block-outermost ones pack them: every group is a ``UniformTypeKVCacheSpecs``
(three of KDA layers, one of MLA + indexer, one of rings). The scheduler's
config keeps each group's first layer spec
(``generate_scheduler_kv_cache_config``); the workers keep the wrappers.

Tables come from vLLM's ``KVCacheManager`` on the scheduler's config; the
prefiller holds the truncated prompt (N-1 tokens), the decoder N tokens,
each with its speculative lookahead.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    CrossAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)
from vllm.v1.request import RequestStatus

from tests.patches.builders import (
    build_worker,
    full_attention_spec,
    kda_mamba_spec,
    make_kv_cache_blocks,
    make_kv_cache_config,
    make_request,
    make_scheduler_connector,
    make_scheduler_output,
    make_vllm_config,
    moriio_kv_transfer_config,
    read_blocks,
    reads_by_layer,
)

BLOCK = 640
KPOOL = 16
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def glm5_next_layer_specs(num_spec: int) -> dict[str, KVCacheSpec]:
    """12 layers (3 KDA : 1 indexed attention) and, with MTP, the MTP layer."""

    def latent(head_size: int, dtype: torch.dtype, **kw: Any) -> MLAAttentionSpec:
        """One latent head on every rank (MLA and its indexer)."""
        return MLAAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=head_size,
            dtype=dtype,
            **kw,
        )

    mla = latent(512, torch.bfloat16, is_index_group_leader=True)
    kda = kda_mamba_spec(
        block_size=BLOCK,
        num_speculative_blocks=num_spec,
        shapes=((3072, 3 + num_spec), (8, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=mla.page_size_bytes,
    )
    indexer = latent(
        128 + 4,
        torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
        tokens_per_state=KPOOL,
    )
    ring_rows = KPOOL * (1 << (-(-(KPOOL + num_spec) // KPOOL) - 1).bit_length())
    ring = CircularBufferSpec(
        block_size=ring_rows,
        num_kv_heads=2,
        head_size=128,
        head_size_v=0,
        dtype=torch.bfloat16,
        dcp_sharded=False,
    )
    specs: dict[str, KVCacheSpec] = {}

    def indexed(prefix: str, draft: bool) -> None:
        for name, spec in (
            ("mla_attn", mla),
            ("indexer.k_cache", indexer),
            ("indexer.tail_cache", ring),
        ):
            specs[f"{prefix}.{name}"] = replace(spec, is_draft=draft)

    for i in range(12):
        if i % 4 == 3:
            indexed(f"model.layers.{i}.self_attn", False)
        else:
            specs[f"model.layers.{i}.linear_attn"] = kda
    if num_spec:
        indexed("model.layers.12.self_attn", True)
    return specs


@dataclass
class Grouping:
    """vLLM's grouping of the specs: the workers' and the scheduler's view."""

    worker: KVCacheConfig
    scheduler: KVCacheConfig

    def kinds(self) -> list[str]:
        out = []
        for group in self.scheduler.kv_cache_groups:
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                out.append("kda")
            elif isinstance(spec, CircularBufferSpec):
                out.append("ring")
            else:
                out.append("mla")
        return out


def real_grouping(vllm_config: Any, num_spec: int, layout: str = "BLNHC") -> Grouping:
    previous = vllm_config.cache_config.kv_cache_layout
    vllm_config.cache_config.kv_cache_layout = layout
    try:
        groups = get_kv_cache_groups(vllm_config, glm5_next_layer_specs(num_spec))
    finally:
        vllm_config.cache_config.kv_cache_layout = previous
    worker = make_kv_cache_config(groups, num_blocks=2048)
    return Grouping(worker, generate_scheduler_kv_cache_config([worker]))


def _configs(model_dir: Path, num_spec: int) -> tuple[Any, Any]:
    spec = MTP if num_spec else None
    return tuple(  # type: ignore[return-value]
        make_vllm_config(
            model_dir,
            moriio_kv_transfer_config(role),
            block_size=BLOCK,
            speculative_config=spec,
        )
        for role in ("kv_producer", "kv_consumer")
    )


@pytest.fixture(params=[0, 1], ids=["no-spec", "mtp"])
def num_spec(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture
def configs(llama_model_dir: Path, deepseek_mtp_model_dir: Path, num_spec: int):
    return _configs(deepseek_mtp_model_dir if num_spec else llama_model_dir, num_spec)


# --------------------------------------------------------------------------
# The real grouping starts
# --------------------------------------------------------------------------


def test_real_grouping_wraps_every_group(configs, num_spec) -> None:
    """What the connector is given on 0.33.0 (holds on the base too)."""
    grouping = real_grouping(configs[0], num_spec)
    assert all(
        isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
        for g in grouping.worker.kv_cache_groups
    )
    assert grouping.kinds() == ["kda", "kda", "kda", "mla", "ring"]
    with pytest.raises(NotImplementedError):
        real_grouping(configs[0], num_spec, layout="LBNHC")


def test_real_grouping_starts_on_both_legs(configs, num_spec) -> None:
    grouping = real_grouping(configs[0], num_spec)
    for config in configs:
        scheduler = make_scheduler_connector(
            config, grouping.scheduler
        ).connector_scheduler
        assert scheduler is not None
        assert scheduler._attn_group_ids == [3, 4]
        assert scheduler._mamba_group_ids == [0, 1, 2]
        assert scheduler._num_ssm_scratch_blocks == num_spec


# --------------------------------------------------------------------------
# READ pairs every group by position, the ring included
# --------------------------------------------------------------------------

_ids = itertools.count()


class Leg:
    """One leg's KV cache manager on the scheduler's config."""

    def __init__(self, grouping: Grouping) -> None:
        self.manager = KVCacheManager(
            grouping.scheduler,
            max_model_len=8192,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=False,
        )

    def allocate(
        self, request: Any, num_tokens: int, lookahead: int
    ) -> list[list[int]]:
        blocks = self.manager.allocate_slots(
            request, num_tokens, num_lookahead_tokens=lookahead
        )
        assert blocks is not None
        return [list(t) for t in self.manager.get_block_ids(request.request_id)]


def _transfer(configs, grouping: Grouping, num_spec: int, n: int, local_hit: int):
    """Prefill N-1 tokens on P, admit N on D; the consumer's ReqMeta and both
    legs' tables."""
    p_conn = make_scheduler_connector(configs[0], grouping.scheduler)
    d_conn = make_scheduler_connector(configs[1], grouping.scheduler)
    rid = f"glm-{next(_ids)}"
    prefill = make_request(rid, n, {"do_remote_decode": True, "transfer_id": rid})
    p_conn.on_new_request(prefill)
    assert prefill.num_prompt_tokens == n - 1
    p_tables = Leg(grouping).allocate(prefill, n - 1, num_spec)
    prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p_conn.request_finished_all_groups(prefill, tuple(p_tables))
    assert delay and params is not None

    decode = make_request(rid, n, params)
    external, load_async = d_conn.get_num_new_matched_tokens(decode, local_hit)
    # Asynchronous where vLLM recovers no failed synchronous load.
    assert not load_async or external > 0
    d_tables = Leg(grouping).allocate(decode, n, 1 + 2 * num_spec)
    d_conn.update_state_after_alloc(decode, make_kv_cache_blocks(d_tables), external)
    meta = d_conn.build_connector_meta(make_scheduler_output())
    return meta.reqs_to_recv[rid], p_tables, d_tables


@pytest.mark.parametrize("n", [2, 17, 640, 641, 1300, 4000])
def test_read_pairs_every_group_by_position(configs, num_spec, n) -> None:
    grouping = real_grouping(configs[0], num_spec)
    req, p_tables, d_tables = _transfer(configs, grouping, num_spec, n, 0)
    payload = [3, 4, 0, 1, 2]  # attention groups, then KDA, in group order
    assert len(req.local_block_ids) == len(req.remote_block_ids) == len(payload)
    for slot, group in enumerate(payload):
        local, remote = req.local_block_ids[slot], req.remote_block_ids[slot]
        kind = grouping.kinds()[group]
        if kind == "mla":
            pages = -(-(n - 1) // BLOCK)
            assert local == d_tables[group][:pages]
            assert remote == p_tables[group][:pages]
        elif kind == "ring":
            # One ring block per request on each leg: the open group's rows.
            assert local == d_tables[group] and len(local) == 1
            assert remote == p_tables[group] and len(remote) == 1
        else:
            # The state after N-1 tokens: P's running slot into D's.
            p_slot = p_tables[group][(n - 2) // BLOCK] if n > 1 else None
            assert remote == [p_slot]
            assert len(local) == 1 and local[0] in d_tables[group]


def test_full_local_hit_reads_the_ring_and_the_state(configs, num_spec) -> None:
    """The decoder caches every MLA page; the ring is never a prefix hit, so
    it is read. The KDA state is read with it, one slot on each leg, or
    (the decoder holds the state of its full local hit) on neither; or,
    with nothing external to load, nothing is read at all."""
    grouping = real_grouping(configs[0], num_spec)
    n = 2 * BLOCK + 9
    req, p_tables, d_tables = _transfer(configs, grouping, num_spec, n, n - 1)
    assert req.local_block_ids[0] == []
    if not any(req.local_block_ids):
        # Nothing external to load: nothing read on either leg.
        assert not any(req.remote_block_ids)
        return
    assert req.local_block_ids[1] == d_tables[4]
    assert req.remote_block_ids[1] == p_tables[4]
    states = list(zip(req.local_block_ids[2:], req.remote_block_ids[2:], strict=True))
    assert all(len(local) == len(remote) == 1 for local, remote in states) or all(
        local == remote == [] for local, remote in states
    )


# --------------------------------------------------------------------------
# Workers route every layer of the wrapped groups to its payload list
# --------------------------------------------------------------------------


def test_workers_route_wrapped_kda_and_ring_layers(stub_mori, configs, num_spec):
    grouping = real_grouping(configs[0], num_spec)
    worker = build_worker(configs[1], grouping.worker)
    payload = [3, 4, 0, 1, 2]
    local = [[10 + g, 20 + g] if g == 3 else [10 + g] for g in payload]
    remote = [[50 + g, 60 + g] if g == 3 else [50 + g] for g in payload]
    try:
        reads = read_blocks(worker, local, remote, "t-route")
    finally:
        worker.shutdown()
    expected = {
        layer: payload.index(g)
        for g, group in enumerate(grouping.worker.kv_cache_groups)
        for layer in group.layer_names
    }
    posted = reads_by_layer(reads)
    assert set(posted) == set(expected)
    for layer, slot in expected.items():
        for _, local_offs, remote_offs in posted[layer]:
            assert local_offs == local[slot], layer
            assert remote_offs == remote[slot], layer


# --------------------------------------------------------------------------
# Fail closed, naming the spec and the group
# --------------------------------------------------------------------------


def test_wrapped_mamba_group_is_accepted(configs, num_spec) -> None:
    kda = {n: kda_mamba_spec(block_size=64) for n in ("kda.0", "kda.1")}
    wrapped = UniformTypeKVCacheSpecs.from_specs(dict(kda))
    assert wrapped is not None
    groups = [
        KVCacheGroupSpec(["attn.0"], full_attention_spec(64)),
        KVCacheGroupSpec(list(kda), wrapped),
    ]
    scheduler = make_scheduler_connector(
        configs[1], make_kv_cache_config(groups)
    ).connector_scheduler
    assert scheduler is not None and scheduler._mamba_group_ids == [1]


def test_unsupported_group_is_refused_naming_spec_and_group(llama_model_dir) -> None:
    config = make_vllm_config(llama_model_dir, moriio_kv_transfer_config())
    # Encoder-decoder cross-attention: a spec no MoRIIO path transfers.
    cross = CrossAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    groups = [
        KVCacheGroupSpec(["layers.3.attn"], full_attention_spec(16)),
        KVCacheGroupSpec(["layers.0.attn", "layers.1.attn"], cross),
    ]
    with pytest.raises(
        NotImplementedError,
        match=r"group 1 \(layers\.0\.attn, 2 layers\): CrossAttentionSpec",
    ):
        make_scheduler_connector(config, make_kv_cache_config(groups))


def test_mamba_refusal_names_the_layer_and_its_group(llama_model_dir) -> None:
    """A Mamba spec whose states and dtypes do not pair up."""
    config = _configs(llama_model_dir, 0)[1]
    kda = kda_mamba_spec(block_size=64)
    bad = kda_mamba_spec(
        block_size=64, shapes=((3, 1024), (4, 64, 64)), dtypes=(torch.bfloat16,)
    )
    groups = [
        KVCacheGroupSpec(["layers.3.attn"], full_attention_spec(64)),
        KVCacheGroupSpec(["layers.0.gdn"], kda),
        KVCacheGroupSpec(["layers.0.bad"], bad),
    ]
    with pytest.raises(
        moriio_common.MoRIIOError,
        match=r"2 shapes and 1 dtypes in the MambaSpec of layer layers\.0\.bad "
        r"\(transfer group 2\)",
    ):
        make_scheduler_connector(config, make_kv_cache_config(groups))


def test_write_mode_refuses_rings(llama_model_dir) -> None:
    config = make_vllm_config(
        llama_model_dir, moriio_kv_transfer_config("kv_producer", read_mode=False)
    )
    ring = CircularBufferSpec(
        block_size=16, num_kv_heads=2, head_size=64, head_size_v=0, dtype=torch.bfloat16
    )
    groups = [
        KVCacheGroupSpec(["layers.0.attn"], full_attention_spec(16)),
        KVCacheGroupSpec(["layers.0.tail"], ring),
    ]
    with pytest.raises(NotImplementedError, match="circular-buffer"):
        make_scheduler_connector(config, make_kv_cache_config(groups))


def test_every_layer_spec_of_the_real_grouping_is_known() -> None:
    """Guards the spec construction above against vLLM renaming fields."""
    specs = glm5_next_layer_specs(1)
    kinds = {type(s).__name__ for s in specs.values()}
    assert kinds == {"MambaSpec", "MLAAttentionSpec", "CircularBufferSpec"}
    assert all(len(iter_layer_specs(s)) == 1 for s in specs.values())
