"""The model-family layouts: built like the pinned vLLM's model code, grouped by
vLLM's own planner, covering every spec kind a decoder-only model builds."""

from __future__ import annotations

import inspect
import re
from dataclasses import replace

import pytest

from vllm_overlay.simulate.families import families, family_layouts
from vllm_overlay.simulate.legs import plan_groups

# Spec kinds no decoder-only model produces.
NOT_DECODER_ONLY = {"CrossAttentionSpec", "EncoderOnlyAttentionSpec"}
# Spec kinds only vLLM's planner builds, from a family's layer specs, and the
# layout whose planning builds them.
BUILT_BY_PLANNER = {
    "UniformTypeKVCacheSpecs": "glm5next-BLNHC",
    # get_hisparse_kv_cache_groups derives them; vLLM refuses HiSparse off CUDA
    # (and MoRIIO is ROCm only), which the matrix row reports.
    "HiSparseHotSpec": "deepseek-v3.2-hisparse",
    "HiSparseResidentSpec": "deepseek-v3.2-hisparse",
}
ABSTRACT = {"KVCacheSpec", "AttentionSpec"}


def _spec_kinds() -> set[str]:
    from vllm.v1 import kv_cache_interface as kvi

    return {
        name
        for name, cls in inspect.getmembers(kvi, inspect.isclass)
        if issubclass(cls, kvi.KVCacheSpec) and cls.__module__ == kvi.__name__
    }


def test_every_family_names_the_vllm_code_it_follows():
    for layout in family_layouts().values():
        assert layout.family, layout.name
        assert re.search(r"[a-z0-9_]+\.py", layout.source), layout.name
        assert re.search(r"get_[a-z_]+", layout.source), layout.name


def test_families_cover_every_spec_kind_a_decoder_only_model_builds():
    built = {type(spec).__name__ for fam in families() for spec in fam.build().values()}
    covered = built | set(BUILT_BY_PLANNER) | NOT_DECODER_ONLY | ABSTRACT
    assert _spec_kinds() - covered == set()
    assert set(BUILT_BY_PLANNER.values()) <= set(family_layouts())


def test_uniform_type_wrapper_comes_from_the_planner():
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    groups = plan_groups(family_layouts()[BUILT_BY_PLANNER["UniformTypeKVCacheSpecs"]])
    assert any(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in groups)


def _grouping(layout) -> object:
    try:
        groups = plan_groups(layout)
    except Exception as exc:  # vLLM refuses this layout's grouping
        return type(exc).__name__
    return [(g.layer_names, g.kv_cache_spec) for g in groups]


@pytest.mark.parametrize("fam", families(), ids=lambda f: f.key)
def test_declared_kv_cache_layouts_are_those_that_change_the_grouping(fam):
    """Layer- and block-outermost layouts are the two grouping regimes
    (``_get_packed_kv_cache_groups``); a family runs under the second only
    where vLLM groups it differently."""
    layout = next(lay for lay in family_layouts().values() if lay.family == fam.title)
    by_layout = {
        kv: _grouping(replace(layout, kv_cache_layout=kv)) for kv in ("LBNHC", "BLNHC")
    }
    differs = by_layout["LBNHC"] != by_layout["BLNHC"]
    assert set(fam.kv_cache_layouts) == ({"LBNHC", "BLNHC"} if differs else {"LBNHC"})
