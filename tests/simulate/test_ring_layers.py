"""The simulated workers' model registers the ring layer objects vLLM's
model code builds where they state the ring's group size (Qwen4 exp's QSA
raw-key ring, ``QSARawKeyCache.compress_ratio``): the real layer, built as
the QSA indexer builds it, stating the layout's own spec. A worker's
connector may read its group size (0057)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vllm_overlay.simulate.families import QWEN4_EXP_INDEXER, family_layouts
from vllm_overlay.simulate.layout_types import QSARawKeyRing
from vllm_overlay.simulate.legs import (
    LegOptions,
    RingLayerError,
    build_leg,
    build_ring_layers,
    leg_config,
)

QWEN4 = ["qwen4-exp-mtp", "qwen4-exp-mtp-BLNHC"]


def _rings(specs: dict[str, object]) -> dict[str, object]:
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    return {n: s for n, s in specs.items() if isinstance(s, CircularBufferSpec)}


@pytest.mark.parametrize("name", QWEN4)
def test_each_qsa_ring_layer_is_vllms_own_stating_the_layouts_spec(name: str):
    from vllm.models.qwen4_exp.common.qsa_indexer import QSARawKeyCache

    layout = family_layouts()[name]
    assert layout.ring is not None and layout.ring.qsa_raw_key is not None
    vllm_config, specs = leg_config(layout, "kv_consumer", 49000, 4160)
    rings = _rings(specs)
    assert build_ring_layers(layout, vllm_config, specs) == len(rings) == 11
    layers = vllm_config.compilation_config.static_forward_context
    ratio = QWEN4_EXP_INDEXER.indexer_compress_ratio
    for layer_name, spec in rings.items():
        layer = layers[layer_name]
        assert type(layer) is QSARawKeyCache
        assert layer.compress_ratio == ratio == layout.ring.group_tokens
        own = layer.get_kv_cache_spec(vllm_config)
        assert replace(own, is_draft=spec.is_draft) == spec  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", QWEN4)
def test_a_leg_holds_its_ring_layers(name: str):
    """Both simulators build their legs here: the byte simulator's ranks and
    the scheduler simulator's engine (``drive.hand_over_worker_metadata``)
    read the ring layers from the leg's ``VllmConfig``."""
    layout = family_layouts()[name]
    leg = build_leg(
        layout, "kv_consumer", 51100, 4160, LegOptions(with_scheduler=False)
    )
    layers = leg.vllm_config.compilation_config.static_forward_context
    rings = _rings(leg_config(layout, "kv_consumer", 51100, 4160)[1])
    assert rings and all(
        getattr(layers.get(n), "compress_ratio", None) == 16 for n in rings
    )


def test_a_spec_the_ring_layer_does_not_state_is_refused():
    layout = family_layouts()["qwen4-exp-mtp"]
    assert layout.ring is not None
    narrow = replace(
        layout,
        ring=replace(
            layout.ring, qsa_raw_key=QSARawKeyRing(compress_ratio=16, head_size=64)
        ),
    )
    vllm_config, specs = leg_config(narrow, "kv_consumer", 49000, 4160)
    with pytest.raises(RingLayerError, match="QSARawKeyCache states"):
        build_ring_layers(narrow, vllm_config, specs)


@pytest.mark.parametrize("name", ["glm5next", "deepseek-v4.1", "step5-mtp"])
def test_a_ring_whose_layer_states_no_group_size_builds_no_layer(name: str):
    layout = family_layouts()[name]
    vllm_config, specs = leg_config(layout, "kv_consumer", 49000, 4160)
    assert _rings(specs)
    assert build_ring_layers(layout, vllm_config, specs) == 0
    assert not vllm_config.compilation_config.static_forward_context
