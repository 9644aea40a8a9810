"""A mechanism layout's per-rank specs: its GQA layers take the sweep's
head geometry, split by TP; GLM's kpool tail ring keeps its own spec on
every rank (one head, TP-replicated like the MLA latents beside it), so
WRITE between unequal TP sizes writes it whole as READ reads it, instead of
a ring split by KV head that the prefiller refuses."""

from __future__ import annotations

import pytest

from vllm_overlay.simulate.bytes.geometry import (
    Geometry,
    layer_total_heads,
    rank_specs,
)
from vllm_overlay.simulate.layouts import expand

RING = "model.layers.1.self_attn.kpool_tail"


@pytest.mark.parametrize("tp", [1, 2])
def test_glm_ring_is_replicated_at_every_tp_and_kv_heads(tp):
    layout = expand(["glm"])[0]
    own = layout.layer_specs()[RING]
    for geometry in (Geometry(), Geometry(kv_heads=1)):
        ring = rank_specs(layout, tp, geometry, 1)[RING]
        assert (ring.num_kv_heads, ring.head_size) == (1, own.head_size)
        assert layer_total_heads(layout, geometry)[RING] is None


def test_gqa_layers_still_take_the_sweeps_heads():
    layout = expand(["llama"])[0]
    name = "model.layers.0.self_attn.attn"
    assert rank_specs(layout, 2, Geometry(), 0)[name].num_kv_heads == 2
    assert layer_total_heads(layout, Geometry())[name] == 4
