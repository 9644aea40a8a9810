"""Patch 0046: READ, and WRITE without window groups, refuse a drafter
reading more than one prefill token ahead (multi-module MTP) at start.

MTP module k writes its KV row of position p from token p + k + 1, so the
prefiller's last rows of every module past the first hold its own sampled
token and drafts. A decoder read or written every position but N - 1
recomputes that one only; vLLM rebuilds a module's stale rows after rejected
drafts only, none before the first decode. vLLM builds the configuration
(``SpeculativeConfig``: ``num_nextn_predict_layers`` modules,
``num_speculative_tokens``) and both roles' scheduler connectors run on it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.kv_cache_interface import KVCacheSpec

from tests.patches.builders import (
    full_attention_spec,
    make_kv_cache_config,
    make_scheduler_connector,
    make_vllm_config,
    moriio_kv_transfer_config,
    sliding_window_spec,
    write_model_dir,
)
from tests.patches.conftest import TINY_DEEPSEEK_MTP_CONFIG

B = 16
ATTN = "model.layers.1.self_attn.attn"
LOCAL = "model.layers.0.self_attn.attn"
DRAFT = "model.layers.61.self_attn.attn"

Groups = list[tuple[list[str], KVCacheSpec]]


def _groups(window: bool) -> Groups:
    """DeepSeek-V3-like: the drafter's layer in the target's full group;
    with ``window`` a sliding-window group beside it."""
    groups: Groups = [([ATTN, DRAFT], full_attention_spec(B))]
    if window:
        groups.append(([LOCAL], sliding_window_spec(B, 128)))
    return groups


def _read_config(
    tmp_path: Path, role: str, modules: int, tokens: int, read_mode: bool = True
):
    model_dir = write_model_dir(
        tmp_path, {**TINY_DEEPSEEK_MTP_CONFIG, "num_nextn_predict_layers": modules}
    )
    return make_vllm_config(
        model_dir,
        moriio_kv_transfer_config(role, read_mode=read_mode),
        block_size=B,
        speculative_config={"method": "mtp", "num_speculative_tokens": tokens},
    )


@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
@pytest.mark.parametrize("modules", [2, 3])
def test_multi_module_mtp_read_is_refused_in_one_line(
    tmp_path: Path, role: str, window: bool, modules: int
) -> None:
    """``modules`` MTP modules drafting as many tokens read that many prefill
    tokens ahead: each leg refuses READ at start in one line naming the
    method and its lookahead."""
    vllm_config = _read_config(tmp_path, role, modules, modules)
    assert vllm_config.num_prefill_lookahead_tokens == modules
    with pytest.raises(NotImplementedError) as refused:
        make_scheduler_connector(vllm_config, make_kv_cache_config(_groups(window)))
    assert (
        "MoRIIO READ supports drafters reading one prefill token ahead, "
        f"got method='mtp' reading {modules} "
    ) in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
@pytest.mark.parametrize(
    ("modules", "tokens"), [(2, 1), (1, 3)], ids=["2modules-1token", "1module-3tokens"]
)
def test_mtp_reading_one_prefill_token_ahead_still_starts_in_read(
    tmp_path: Path, window: bool, modules: int, tokens: int
) -> None:
    """One module drafting several tokens, or several modules drafting one,
    read one prefill token ahead: READ starts on both legs."""
    for role in ("kv_producer", "kv_consumer"):
        vllm_config = _read_config(tmp_path, role, modules, tokens)
        assert vllm_config.num_prefill_lookahead_tokens == 1
        make_scheduler_connector(vllm_config, make_kv_cache_config(_groups(window)))


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
@pytest.mark.parametrize("modules", [2, 3])
def test_multi_module_mtp_write_without_windows_is_refused_in_one_line(
    tmp_path: Path, role: str, modules: int
) -> None:
    """WRITE writes the decoder every position but N - 1 of the full group as
    READ reads them, the later modules' last rows included: without a window
    group each leg refuses WRITE at start in one line too."""
    vllm_config = _read_config(tmp_path, role, modules, modules, read_mode=False)
    assert vllm_config.num_prefill_lookahead_tokens == modules
    with pytest.raises(NotImplementedError) as refused:
        make_scheduler_connector(vllm_config, make_kv_cache_config(_groups(False)))
    assert (
        "MoRIIO WRITE supports drafters reading one prefill token ahead, "
        f"got method='mtp' reading {modules} "
    ) in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("modules", "tokens"), [(2, 1), (1, 3)], ids=["2modules-1token", "1module-3tokens"]
)
def test_mtp_reading_one_prefill_token_ahead_still_starts_in_write(
    tmp_path: Path, modules: int, tokens: int
) -> None:
    """A drafter reading one prefill token ahead starts in WRITE on both legs
    of a full-attention layout."""
    for role in ("kv_producer", "kv_consumer"):
        vllm_config = _read_config(tmp_path, role, modules, tokens, read_mode=False)
        assert vllm_config.num_prefill_lookahead_tokens == 1
        make_scheduler_connector(vllm_config, make_kv_cache_config(_groups(False)))
