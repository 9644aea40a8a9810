"""Patch 0030: hybrid WRITE moves Mamba groups of any state count.

Qwen4-exp keeps a one-array short-convolution state (PLE, the same on every
TP rank) beside its GDN layers' conv + SSM pairs; LFM3's ShortConv layers
keep one conv state. READ moves them; WRITE refused them at
start ("supports exactly two Mamba states (conv and SSM)", and Mamba groups
of different specs: "to use the same cache spec").

The scheduler side runs on two real vLLM ``Scheduler``s, a prefill and a
decode leg, with the prefiller's writer planning each layer's write against
a worker stand-in. The worker side registers KV cache
tensors that vLLM's ``allocate_kv_cache`` lays out, in both KV cache
layouts, on real WRITE-mode ``MoRIIOConnectorWorker``s over stubbed mori;
the prefiller's ``MoRIIOWriter`` plans and carries out the write of each
state layer byte by byte.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_engine
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import MambaSpec

from tests.patches.builders import (
    RegisteredWorker,
    WritePair,
    build_drafted_write_pair,
    check_states_copied,
    fill_random,
    full_attention_spec,
    make_vllm_config,
    moriio_kv_transfer_config,
    paired_sessions,
    prompt,
    register_worker,
)
from tests.patches.test_0021_any_mamba_state_count import (
    MTP,
    B,
    Layout,
    qwen4_like,
    short_conv_spec,
)

NULL = 0


def short_conv_like() -> Layout:
    """An LFM3-like ShortConv state beside full attention (no window)."""
    return Layout(
        {
            "model.layers.2.self_attn.attn": full_attention_spec(B),
            "model.layers.0.short_conv": short_conv_spec(),
        },
        ("full", "state"),
    )


LAYOUTS: dict[str, Callable[[], Layout]] = {
    "qwen4-like": qwen4_like,
    "qwen4-like-mtp": lambda: qwen4_like(MTP["num_speculative_tokens"]),
    "short-conv-like": short_conv_like,
}
WHOLE_STATE_LAYERS = {"model.layers.0.ple", "model.layers.0.short_conv"}
"""The layers of these layouts whose states have no conv split."""


def _model_dir(layout: Layout, request: pytest.FixtureRequest) -> Path:
    name = "deepseek_mtp_model_dir" if layout.num_spec else "llama_model_dir"
    return Path(request.getfixturevalue(name))


# --------------------------------------------------------------------------
# Scheduler side: two real vLLM Schedulers
# --------------------------------------------------------------------------


def _write_pair(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, layout: Layout
) -> WritePair:
    state_layers = {
        name
        for name, kind in zip(layout.specs, layout.kinds, strict=True)
        if kind == "state"
    }
    drafter = MTP if layout.num_spec else None
    pair = build_drafted_write_pair(
        model_dir, monkeypatch, layout.groups(), B, drafter, state_layers
    )
    assert pair.layers == {name: g for g, name in enumerate(layout.specs)}
    pair.whole_state_layers = state_layers & WHOLE_STATE_LAYERS
    return pair


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens"),
    [(18, 0), (100, 0), (130, 0), (100, 48), (130, 64)],
    ids=["18", "100", "130", "100-hit48", "130-hit64"],
)
def test_write_starts_and_writes_each_state_groups_running_slot(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    num_tokens: int,
    hit_tokens: int,
) -> None:
    """WRITE starts with a one-state Mamba group, beside a conv + SSM group
    of another spec; each state group writes the prefiller's running slot
    into the decoder's last slot, the attention groups the pages past the
    decoder's hit (with MTP vLLM drops the hit's trailing page)."""
    layout = LAYOUTS[name]()
    pair = _write_pair(_model_dir(layout, request), monkeypatch, layout)
    write = pair.write(prompt(3, num_tokens), decode_hit_tokens=hit_tokens)
    assert write.notices == []
    held = write.message["num_held_blocks"]
    hit_pages = hit_tokens // B - (1 if layout.num_spec and hit_tokens else 0)
    last = cdiv(num_tokens - 1, B)
    for layer, group in pair.layers.items():
        pairs = write.pairs_by_layer[layer]
        if layer in pair.state_layers:
            assert held[group] == 0
            ((prefill_slot, decode_slot),) = pairs
            assert prefill_slot in write.prefill_tables[group], layer
            assert decode_slot == write.message["block_notify_list"][group][-1]
        else:
            assert held[group] == hit_pages
            prefill, decode = write.prefill_tables[group], write.decode_tables[group]
            assert pairs == [(prefill[k], decode[k]) for k in range(hit_pages, last)], (
                layer
            )
            assert all(NULL not in p for p in pairs)


# --------------------------------------------------------------------------
# Worker side: real registration, the WRITE carried out byte by byte
# --------------------------------------------------------------------------


def _leg(
    model_dir: Path, role: str, layout: Layout, kv_layout: str
) -> RegisteredWorker:
    vllm_config = make_vllm_config(
        model_dir,
        moriio_kv_transfer_config(role, read_mode=False),
        block_size=B,
        speculative_config=MTP if layout.num_spec else None,
    )
    return register_worker(
        vllm_config, dict(layout.specs), kv_layout, f"127.0.0.1:{role}"
    )


def _state_layers(worker: Any) -> dict[str, MambaSpec]:
    return {
        name: spec
        for name, spec in worker.layer_to_spec.items()
        if isinstance(spec, MambaSpec)
    }


def _slot_lists(leg: RegisteredWorker, slot: int) -> list[list[int]]:
    """WRITE's block lists, in transfer-group order: ``slot`` for each state
    group, page 1 for each attention group."""
    return [
        [slot] if isinstance(group.kv_cache_spec, MambaSpec) else [1]
        for group in leg.kv_cache_config.transfer_groups
    ]


@pytest.mark.parametrize("kv_layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_worker_registers_and_writes_every_state(
    copying_mori: None, request: pytest.FixtureRequest, name: str, kv_layout: str
) -> None:
    """Each state of each Mamba layer is registered as its own region and
    written whole from the prefiller's running slot into the decoder's
    slot; a conv + SSM pair keeps its conv split; no other byte of the
    decoder's cache changes."""
    layout = LAYOUTS[name]()
    model_dir = _model_dir(layout, request)
    p = _leg(model_dir, "kv_producer", layout, kv_layout)
    d = _leg(model_dir, "kv_consumer", layout, kv_layout)
    try:
        generator = torch.Generator().manual_seed(30)
        for leg in (p, d):
            fill_random(leg.buffer, generator)
        before = d.buffer.clone()
        worker = p.worker
        state_layers = _state_layers(worker)
        assert set(worker._conv_decomps) == set(state_layers) - WHOLE_STATE_LAYERS
        for layer, spec in state_layers.items():
            assert len(worker.layer_name_to_local_kv_cache_metadata[layer]) == len(
                spec.shapes
            )
        sessions = paired_sessions(worker, d.worker)
        writer = moriio_engine.MoRIIOWriter(worker)
        prefill_slot, decode_slot = 3, 5
        request_info = types.SimpleNamespace(block_ids=_slot_lists(d, decode_slot))
        for layer in state_layers:
            task = types.SimpleNamespace(
                request_id="r",
                transfer_id="t",
                layer_name=layer,
                local_block_ids=_slot_lists(p, prefill_slot),
                remote_tp_size=1,
            )
            plans = writer._prepare_mamba_transfer_plans(task, request_info)  # type: ignore[arg-type]
            for plan in plans:
                writer._do_layer_write(plan, sessions)
        check_states_copied(d, p, state_layers, before, decode_slot, prefill_slot)
    finally:
        p.worker.shutdown()
        d.worker.shutdown()
