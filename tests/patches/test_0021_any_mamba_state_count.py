"""Patch 0021: hybrid READ moves Mamba groups of any state count.

Qwen4-exp keeps a one-array short-convolution state (PLE, the same on every
TP rank) beside its GDN layers' conv + SSM pairs; LFM3's ShortConv layers
keep one conv state beside full and sliding-window attention. MoRIIO
refused both at start ("supports exactly two Mamba states (conv and SSM)"),
on the scheduler and on the workers.

The scheduler side runs on two real vLLM ``Scheduler``s, a prefill and a
decode leg (the Qwen4-exp-like layout with MTP: one scratch state slot per
group, its drafter in a group of the target's spec). The worker side
registers KV cache tensors that vLLM's ``allocate_kv_cache`` lays out, in
both KV cache layouts, on the real ``MoRIIOConnectorWorker`` over stubbed
mori; its READ of the state regions is carried out byte by byte.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

from tests.patches.builders import (
    RegisteredWorker,
    SchedulerPair,
    check_states_copied,
    fill_random,
    full_attention_spec,
    kda_mamba_spec,
    make_kv_cache_config,
    make_scheduler_connector,
    make_vllm_config,
    moriio_kv_transfer_config,
    paired_sessions,
    prompt,
    read_blocks,
    register_worker,
    sliding_window_spec,
)
from tests.patches.vllm_unit_utils import create_scheduler

B, W = 16, 64
MTP = {"method": "mtp", "num_speculative_tokens": 1}
# A page every state below fits in: 16 tokens x 2 KV heads x 64 x bf16 x K, V.
PAGE = full_attention_spec(B).page_size_bytes


def gdn_spec(num_spec: int = 0) -> MambaSpec:
    """A GDN layer's conv (Q, K, V of 32, 32, 64 columns) and SSM state."""
    return kda_mamba_spec(
        block_size=B,
        num_speculative_blocks=num_spec,
        shapes=((128, 3 + num_spec), (2, 32, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=PAGE,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )


def ple_spec(num_spec: int = 0) -> MambaSpec:
    """Qwen4-exp's PLE layer: one short-conv array, TP-replicated."""
    return kda_mamba_spec(
        block_size=B,
        num_speculative_blocks=num_spec,
        shapes=((256, 3),),
        dtypes=(torch.bfloat16,),
        page_size_padded=PAGE,
        tp_replicated=True,
    )


def short_conv_spec() -> MambaSpec:
    """LFM3's ShortConv: one conv state (``short_conv_state_shape``)."""
    return kda_mamba_spec(
        block_size=B,
        shapes=((320, 6),),
        dtypes=(torch.bfloat16,),
        page_size_padded=PAGE,
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
    )


@dataclass(frozen=True)
class Layout:
    """Per-layer specs in vLLM's group order and each group's kind."""

    specs: dict[str, KVCacheSpec]
    kinds: tuple[str, ...]
    """Per group: "full", "window" or "state"."""
    num_spec: int = 0

    def groups(self) -> list[tuple[list[str], KVCacheSpec]]:
        return [([name], spec) for name, spec in self.specs.items()]


def qwen4_like(num_spec: int = 0) -> Layout:
    """QSA attention, its MTP drafter's layer (the target's spec), GDN, PLE."""
    target = full_attention_spec(B)
    return Layout(
        {
            "model.layers.3.self_attn.attn": target,
            "mtp.layers.0.self_attn.attn": replace(target, is_draft=True),
            "model.layers.0.linear_attn": gdn_spec(num_spec),
            "model.layers.0.ple": ple_spec(num_spec),
        },
        ("full", "full", "state", "state"),
        num_spec,
    )


def lfm3_like() -> Layout:
    return Layout(
        {
            "model.layers.2.self_attn.attn": full_attention_spec(B),
            "model.layers.4.self_attn.attn": sliding_window_spec(B, W),
            "model.layers.0.short_conv": short_conv_spec(),
        },
        ("full", "window", "state"),
    )


LAYOUTS = {
    "qwen4-like": qwen4_like,
    "qwen4-like-mtp": lambda: qwen4_like(MTP["num_speculative_tokens"]),
    "lfm3-like": lfm3_like,
}


# --------------------------------------------------------------------------
# Scheduler side: two real vLLM Schedulers
# --------------------------------------------------------------------------


def _pair(model_dir: Path, layout: Layout) -> SchedulerPair:
    legs = []
    for role in ("kv_producer", "kv_consumer"):
        vllm_config = make_vllm_config(
            model_dir,
            moriio_kv_transfer_config(role),
            block_size=B,
            speculative_config=MTP if layout.num_spec else None,
        )
        kv_cache_config = make_kv_cache_config(layout.groups(), 2048)
        kv_cache_config.hash_block_size = B
        kv_cache_config.cache_hit_alignment_tokens = B
        with set_current_vllm_config(vllm_config):
            legs.append(create_scheduler(vllm_config, 2048, kv_cache_config))
    return SchedulerPair(legs[0], legs[1], B)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_pair(
    request: pytest.FixtureRequest, llama_model_dir: Path, deepseek_mtp_model_dir: Path
) -> tuple[Layout, SchedulerPair]:
    layout = LAYOUTS[request.param]()
    model_dir = deepseek_mtp_model_dir if layout.num_spec else llama_model_dir
    return layout, _pair(model_dir, layout)


def _payload(layout: Layout) -> list[int]:
    """The READ payload's group order: attention groups, then state groups."""
    attention = [g for g, kind in enumerate(layout.kinds) if kind != "state"]
    return [*attention, *(g for g, kind in enumerate(layout.kinds) if kind == "state")]


def _loads_async() -> bool:
    """Whether READ loads asynchronously (vLLM recovers no failed synchronous
    load by request)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector,
    )

    recovers = getattr(moriio_connector, "recovers_failed_sync_kv_loads", None)
    return recovers is not None and not recovers()


@pytest.mark.parametrize("n", [2, 18, 100, 129, 530])
@pytest.mark.parametrize("hit_pages", [0, 1])
def test_read_pairs_every_state_group_by_position(layout_pair, n, hit_pages) -> None:
    """Each state group reads the prefiller's running state after N - 1
    tokens into the decoder's slot for position N - 1; attention pages pair
    by position and cover what the decoder lacks (with MTP, vLLM's hit is a
    page shorter than what the decoder cached)."""
    layout, pair = layout_pair
    cached = min(hit_pages * B, (n - 1) // B * B)
    read = pair.read(prompt(n + 100 * hit_pages, n), cached)
    hit = read.decode_hit_tokens
    assert hit == (max(cached - B, 0) if layout.num_spec else cached)
    payload = _payload(layout)
    assert len(read.local_block_ids) == len(read.remote_block_ids) == len(payload)
    last = -(-(n - 1) // B)
    for slot, group in enumerate(payload):
        local, remote = read.local_block_ids[slot], read.remote_block_ids[slot]
        p_table, d_table = read.prefill_tables[group], read.decode_tables[group]
        if layout.kinds[group] == "state":
            assert remote == [p_table[(n - 2) // B]], group
            # The slot of position N - 1; an asynchronous load's is N - 2's,
            # which vLLM's align-mode copy takes it from when it computes N - 1.
            assert local == [d_table[(n - 2 if _loads_async() else n - 1) // B]], group
            continue
        pairs = list(zip(local, remote, strict=True))
        assert all(d_table.index(d) == p_table.index(p) for d, p in pairs), group
        first = hit // B
        if layout.kinds[group] == "window":
            first = max(first, max(n - W, 0) // B)
        read_pages = {d_table.index(d) for d, _ in pairs}
        assert set(range(first, last)) <= read_pages, group


@pytest.mark.parametrize("pages", [1, 6])
@pytest.mark.parametrize("layout_pair", ["qwen4-like", "lfm3-like"], indirect=True)
def test_full_local_hit_reads_nothing(layout_pair, pages) -> None:
    """Nothing external to load: no page and no state slot is read (the
    decoder holds its hit's state). With MTP, vLLM's hit is never the
    whole prompt (it drops the last matched page)."""
    _, pair = layout_pair
    n = pages * B + 1
    read = pair.read(prompt(700 + pages, n), n - 1)
    assert read.decode_hit_tokens == n - 1
    assert not any(read.local_block_ids) and not any(read.remote_block_ids)


# --------------------------------------------------------------------------
# Refusals at start
# --------------------------------------------------------------------------


def _connector(model_dir: Path, layout: Layout, dcp: int = 1, **transfer: Any) -> Any:
    config = make_vllm_config(
        model_dir, moriio_kv_transfer_config("kv_producer", **transfer), block_size=B
    )
    config.parallel_config.decode_context_parallel_size = dcp
    return make_scheduler_connector(config, make_kv_cache_config(layout.groups()))


def test_write_refuses_a_one_state_group_at_start(llama_model_dir: Path) -> None:
    """LFM3-like under DCP 2 stays refused in WRITE at start, in one line
    naming its group: for its one-state group, or, where WRITE moves any
    state count, for its window group (beside the state group, or under DCP
    where WRITE serves it beside one)."""
    with pytest.raises(
        (moriio_common.MoRIIOError, NotImplementedError),
        match=r"WRITE supports exactly two Mamba states \(conv and SSM\), got 1 "
        r"in the MambaSpec of layer model\.layers\.0\.short_conv \(transfer group "
        r"2\); use READ mode|WRITE mode does not support sliding-window cache "
        r"groups (beside Mamba state groups|under decode context parallelism "
        r"\(DCP 2\)): group 1 ",
    ):
        _connector(llama_model_dir, lfm3_like(), dcp=2, read_mode=False)


def test_a_state_without_its_dtype_is_refused_at_start(llama_model_dir: Path) -> None:
    layout = lfm3_like()
    broken = replace(short_conv_spec(), shapes=((320, 6), (4, 4)))
    specs = {**layout.specs, "model.layers.0.short_conv": broken}
    with pytest.raises(
        moriio_common.MoRIIOError,
        match=r"at least one Mamba state and one dtype per state, got 2 shapes "
        r"and 1 dtypes in the MambaSpec of layer model\.layers\.0\.short_conv",
    ):
        _connector(llama_model_dir, replace(layout, specs=specs))


# --------------------------------------------------------------------------
# Worker side: real registration, the READ carried out byte by byte
# --------------------------------------------------------------------------


def _leg(
    model_dir: Path, role: str, layout: Layout, kv_layout: str
) -> RegisteredWorker:
    vllm_config = make_vllm_config(
        model_dir,
        moriio_kv_transfer_config(role),
        block_size=B,
        speculative_config=MTP if layout.num_spec else None,
    )
    return register_worker(
        vllm_config, dict(layout.specs), kv_layout, f"127.0.0.1:{role}"
    )


def _state_groups(config: KVCacheConfig) -> list[KVCacheGroupSpec]:
    def is_state(spec: KVCacheSpec) -> bool:
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return all(isinstance(s, MambaSpec) for s in spec.kv_cache_specs.values())
        return isinstance(spec, MambaSpec)

    return [g for g in config.transfer_groups if is_state(g.kv_cache_spec)]


@pytest.mark.parametrize("kv_layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_worker_registers_and_reads_every_state(
    copying_mori, llama_model_dir, deepseek_mtp_model_dir, name, kv_layout
) -> None:
    """Each state of each Mamba layer is registered as its own region and
    read whole from the prefiller's running slot into the decoder's; no
    other byte of the decoder's cache changes."""
    layout = LAYOUTS[name]()
    model_dir = deepseek_mtp_model_dir if layout.num_spec else llama_model_dir
    p = _leg(model_dir, "kv_producer", layout, kv_layout)
    d = _leg(model_dir, "kv_consumer", layout, kv_layout)
    generator = torch.Generator().manual_seed(21)
    for leg in (p, d):
        fill_random(leg.buffer, generator)
    before = d.buffer.clone()
    worker = d.worker
    state_layers = {
        name: cast_spec
        for group in _state_groups(d.kv_cache_config)
        for name in group.layer_names
        if isinstance(cast_spec := worker.layer_to_spec[name], MambaSpec)
    }
    for name, spec in state_layers.items():
        assert len(worker.layer_name_to_local_kv_cache_metadata[name]) == len(
            spec.shapes
        )
    # One session per registered region, in registration order.
    sessions = paired_sessions(worker, p.worker)
    worker._get_built_session = lambda engine_id: (sessions, object())
    worker._compute_read_attention_offsets = lambda *a, **k: ([], [], [])
    num_attn = worker._num_attn_transfer_groups
    num_state = worker._num_mamba_transfer_groups
    local_slot, remote_slot = 5, 3
    read_blocks(
        worker,
        [[1]] * num_attn + [[local_slot]] * num_state,
        [[1]] * num_attn + [[remote_slot]] * num_state,
        "t-states",
    )
    check_states_copied(d, p, state_layers, before, local_slot, remote_slot)
