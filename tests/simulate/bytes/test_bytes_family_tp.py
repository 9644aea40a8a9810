"""A model family's ranks at a TP size are built as the model's code builds
them: Step5's CSA tail ring is one page of its rank's main layer (a rank of
two holds half the KV groups, so half the page), LFM3's ShortConv state
holds the rank's share of the conv channels, its page padded to the
rank's own attention page."""

from __future__ import annotations

import pytest

from vllm_overlay.simulate.bytes.geometry import Geometry, rank_specs
from vllm_overlay.simulate.layouts import expand


def _specs(name: str, tp: int) -> dict:
    layout = expand([name])[0]
    return rank_specs(
        layout, tp, Geometry(), layout.decode_slots.num_speculative_tokens
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_step5_ring_is_one_page_of_its_ranks_main_layer(tp):
    """``Step5CSATailRing.get_kv_cache_spec``: the ring's page is its main
    layer's page on the same rank, whose KV groups TP splits."""
    specs = _specs("step5-mtp", tp)
    layer = "model.layers.3.self_attn"
    main, ring = specs[f"{layer}.attn"], specs[f"{layer}.csa_tail_ring"]
    assert main.num_kv_heads == 8 // tp
    assert ring.page_size_bytes == main.page_size_bytes
    assert ring.block_size == main.block_size


@pytest.fixture
def dim_first_conv_state(monkeypatch):
    """vLLM caches the conv state layout it read first: clear it on both
    sides, so a test that ran before in this process decides nothing."""
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    mamba_utils.get_conv_state_layout.cache_clear()
    yield
    mamba_utils.get_conv_state_layout.cache_clear()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.usefixtures("dim_first_conv_state")
def test_lfm3_conv_state_is_the_ranks_share(tp):
    """``ShortConv.get_state_shape``: ``1 / tp`` of the conv channels, the
    page padded to the rank's own attention page; the full and windowed
    layers hold the rank's share of the KV heads."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateShapeCalculator,
    )

    specs = _specs("lfm3", tp)
    conv, attn = (
        specs["model.layers.0.short_conv"],
        specs["model.layers.2.self_attn.attn"],
    )
    assert conv.shapes == MambaStateShapeCalculator.short_conv_state_shape(tp, 2048, 7)
    assert attn.num_kv_heads == 4 // tp
    assert specs["model.layers.4.self_attn.attn"].num_kv_heads == 4 // tp
    assert conv.page_size_bytes == attn.page_size_bytes


@pytest.mark.parametrize("tp", [1, 2])
def test_step5_ring_holds_its_ranks_page_in_rows(tp):
    """The judge addresses Step5's ring as the model binds it
    (``Step5CSATailRing.bind_kv_cache``): its rank's page in 1 KB rows,
    256 at TP 1 and 128 at TP 2."""
    from vllm_overlay.simulate.bytes.geometry import model_json
    from vllm_overlay.simulate.check import RING
    from vllm_overlay.simulate.drive import group_infos
    from vllm_overlay.simulate.legs import LegOptions, build_leg

    layout = expand(["step5-mtp"])[0]
    geometry = Geometry(kv_heads=1)
    leg = build_leg(
        layout,
        "kv_consumer",
        1,
        600,
        LegOptions(
            tensor_parallel_size=tp,
            model_json=model_json(layout, geometry),
            specs=lambda: rank_specs(layout, tp, geometry, 1),
            extra_config={"proxy_ip": ""},
            with_scheduler=False,
        ),
    )
    rings = [g for g in group_infos(leg, layout) if g.kind == RING]
    assert [g.ring_capacity for g in rings] == [256 // tp]


@pytest.mark.parametrize("tp", [1, 2])
def test_zaya_cca_state_is_kept_whole_and_replicated(tp):
    """ZAYA's CCA state (``ZayaCCA.get_state_shape``: the q/k history and
    the delayed value, the same on every TP rank) is no conv + SSM pair:
    every rank keeps the family's state, padded to its own attention page
    (its share of the 2 KV heads), and the
    judge reads each of its arrays whole, at the same bytes on every rank."""
    from types import SimpleNamespace

    from vllm_overlay.simulate.bytes.judge import state_regions

    declared = expand(["zaya"])[0].layer_specs()["model.layers.0.self_attn.qkv_proj"]
    specs = _specs("zaya", tp)
    cca, attn = (
        specs["model.layers.0.self_attn.qkv_proj"],
        specs["model.layers.0.self_attn.attn"],
    )
    assert (cca.shapes, cca.dtypes, cca.mamba_type, cca.tp_replicated) == (
        declared.shapes,
        declared.dtypes,
        declared.mamba_type,
        True,
    )
    assert attn.num_kv_heads == 2 // tp
    assert cca.page_size_bytes == attn.page_size_bytes
    regions = state_regions(SimpleNamespace(spec=cca), tp - 1, tp)
    assert [(k, first) for k, _, _, first in regions] == [(0, 0), (1, 0)]
    assert sum(size for _, _, size, _ in regions) == cca.real_page_size_bytes
