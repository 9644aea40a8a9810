"""The simulator's verdict on the installed vLLM (overlaid in ``nox -s unit``).

These fail on the pinned base (``nox -s unit-base``) and pass with the whole
series: hybrid READ of several attention groups (0001), the window no longer
shifted by a decode lookahead tail (0002), a prefix hit that reads only the
pages the decoder lacks (0005), the window's first block read from the
prefiller, never its null block (0008), GLM-5.3-Flash's real grouping
(moriio-read-rings-and-wrapped-state-groups) and READ destinations kept out of
zeroing (moriio-read-destinations-out-of-zeroing).
"""

from __future__ import annotations

import pytest

from vllm_overlay.simulate.drive import Pair
from vllm_overlay.simulate.layouts import expand


def _pair(name: str, port: int) -> Pair:
    return Pair(expand([name])[0], max_model_len=4160, port=port)


@pytest.fixture(scope="module")
def dsv4():
    return _pair("dsv4", 48000)


def test_dsv4_window_is_not_shifted_by_the_decode_lookahead(dsv4):
    # Seed 001's lengths: (N - 1) % 64 >= 55 with the list clipped.
    lengths = [251, 377, 384, 440, 636, 832, 1000, 2039, 4094]
    results = [dsv4.run_case(n, 0.0) for n in lengths]
    assert [r.error for r in results] == [None] * len(lengths)
    assert [r.n for r in results if r.wrong] == []


@pytest.mark.parametrize("hit", [0.0, 0.5])
def test_dsv4_reads_the_window_start_the_prefiller_used_to_free(dsv4, hit):
    # N % 64 == 63: N-W ends its block; N % 64 == 0: the clip starts one block
    # below the window. Seed 001's 447 and 895 are of the first kind.
    lengths = [191, 192, 447, 448, 895, 896, 4031, 4032]
    results = [dsv4.run_case(n, hit) for n in lengths]
    assert [r.error for r in results] == [None] * len(lengths)
    assert [r.n for r in results if r.wrong] == []
    assert sum(r.null_reads for r in results) == 0


@pytest.fixture(scope="module")
def gemma():
    return _pair("gemma", 48600)


@pytest.mark.parametrize("hit", [0.0, 0.5, 0.897])
def test_gemma_reads_the_window_start_the_prefiller_used_to_free(gemma, hit):
    lengths = [527, 528, 543, 544, 1039, 1040, 4095, 4096]
    results = [gemma.run_case(n, hit) for n in lengths]
    assert [r.error for r in results] == [None] * len(lengths)
    assert [r.n for r in results if r.wrong] == []


@pytest.fixture(scope="module")
def kimi():
    return _pair("kimi", 48200)


@pytest.mark.parametrize("n", [1000, 2500, 4096])
def test_kimi_prefix_hit_reads_only_the_missing_pages(kimi, n):
    result = kimi.run_case(n, 0.897)
    assert result.error is None and not result.wrong
    assert result.local_hit_tokens > 0
    assert result.pages_read == result.min_pages
    assert result.bytes_read == result.min_bytes


@pytest.fixture(scope="module")
def glm():
    # The base refuses this layout at start: report that as the test failing.
    try:
        return _pair("glm", 48400)
    except Exception as exc:
        return exc


@pytest.mark.parametrize("hit", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("n", [127, 449, 1000, 3001])
def test_glm_two_attention_groups_kda_and_mtp_read_the_right_kv(glm, n, hit):
    assert isinstance(glm, Pair), f"refused at start: {glm}"
    result = glm.run_case(n, hit)
    assert result.error is None
    assert not result.wrong


# Model families built as vLLM 0.33.0 builds them (families.py).


@pytest.fixture(scope="module")
def glm5next_real():
    try:
        return _pair("glm5next-mtp-BLNHC", 48600)
    except Exception as exc:  # the base and #60867 refuse the ring at start
        return exc


@pytest.mark.parametrize("hit", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("n", [17, 641, 1290, 4000])
def test_glm5next_real_grouping_with_mtp_reads_the_right_kv(glm5next_real, n, hit):
    """GLM-5.3-Flash as vLLM 0.33.0 groups it (block-outermost: wrapped KDA
    groups, a CircularBufferSpec tail ring), MTP on both legs
    (moriio-read-rings-and-wrapped-state-groups)."""
    assert isinstance(glm5next_real, Pair), f"refused at start: {glm5next_real}"
    kinds = [g.kind for g in glm5next_real.groups]
    assert kinds == ["state", "state", "state", "full", "ring"]
    result = glm5next_real.run_case(n, hit)
    assert result.error is None
    assert not result.wrong


def test_deepseek_v4_pro_read_destinations_are_not_zeroed():
    """Mixed precisions (fp32 compressor states) make vLLM zero fresh pages;
    non-hybrid READ must keep its destinations out of that list
    (moriio-read-destinations-out-of-zeroing)."""
    pair = _pair("deepseek-v4-pro-BLNHC", 48800)
    results = [pair.run_case(n, 0.0) for n in (100, 1000, 3001)]
    assert [r.error for r in results] == [None] * 3
    assert [r.n for r in results if r.wrong] == []


@pytest.fixture(scope="module")
def qwen35_eagle3():
    try:
        return _pair("qwen3.5-eagle3", 49000)
    except Exception as exc:  # the base refuses hybrid READ with >1 group
        return exc


@pytest.mark.parametrize("hit", [0.0, 0.897])
@pytest.mark.parametrize("n", [300, 2000])
def test_eagle3_drafter_owning_its_group_reads_the_right_kv(qwen35_eagle3, n, hit):
    """Hybrid READ with an EAGLE3 drafter in a group of its own: the drafter's
    group is checked like every other (0001, 0006)."""
    assert isinstance(qwen35_eagle3, Pair), f"refused at start: {qwen35_eagle3}"
    drafter = [
        g for g in qwen35_eagle3.d.kv_cache_config.kv_cache_groups if g.is_eagle_group
    ]
    assert len(drafter) == 1 and drafter[0].layer_names == [
        "drafter.model.layers.0.self_attn.attn"
    ]
    result = qwen35_eagle3.run_case(n, hit)
    assert result.error is None
    assert not result.wrong
