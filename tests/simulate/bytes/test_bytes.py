"""Byte level, sampled: both legs' real MoRIIO workers (the installed vLLM,
overlaid in ``nox -s unit``) move real KV cache tensors over the loopback
``mori`` stand-in; ``nox -s simulate-bytes`` runs the full table.

The session's zygote (``conftest.byte_zygote``) runs every configuration
below, each in forked rank processes. The checker is tested in the same run:
a shifted source offset, a shifted destination offset and a wrong head split
must all be reported.
"""

from __future__ import annotations

import pytest

from vllm_overlay.simulate.bytes.report import ConfigItem, ConfigReport
from vllm_overlay.simulate.bytes.run import ZygoteSession

LENGTHS = "2,65,120,250,530"
HITS = "0,50"

# One of everything: each layout, both modes, every TP pair kind (equal,
# fan-out, fan-in), both KV cache layouts; READ and WRITE with unequal TP
# slice heads (4 KV heads) or copy replicated ones (1 KV head).
SAMPLED = [
    ConfigItem("llama", "read", 1, 1, "LBNHC"),
    ConfigItem("llama", "read", 1, 2, "BLNHC", kv_heads=1),
    ConfigItem("llama", "read", 1, 2, "LBNHC"),
    ConfigItem("llama", "write", 2, 1, "BLNHC"),
    ConfigItem("llama", "write", 1, 2, "LBNHC"),
    ConfigItem("gemma", "read", 2, 2, "LBNHC"),
    ConfigItem("dsv4", "read", 1, 1, "BLNHC"),
    ConfigItem("kimi", "read", 2, 2, "LBNHC"),
    ConfigItem("kimi", "read", 1, 2, "LBNHC"),
    ConfigItem("kimi", "write", 1, 2, "BLNHC"),
    ConfigItem("glm", "read", 1, 1, "BLNHC"),
    # Model families of the matrix, in their own head geometry: MLA with
    # the fp8 DSA indexer (132-byte rows), MLA gathered from two prefill ranks,
    # GQA + indexer.
    ConfigItem("deepseek-v3.2-mtp", "read", 1, 1, "LBNHC"),
    ConfigItem("deepseek-v3", "write", 2, 1, "LBNHC"),
    ConfigItem("minimax-m3", "read", 2, 2, "LBNHC"),
    # Decode context parallelism: positions interleaved over the DCP ranks.
    ConfigItem("llama/dcp2", "read", 2, 2, "LBNHC", kv_heads=1),
    ConfigItem("deepseek-v3/dcp2", "write", 2, 2, "LBNHC", kv_heads=1),
]
# Group kinds the pinned connector may refuse and a later patch may carry
# (the circular-buffer rings of DeepSeek-V4.1, GLM-5.3-Flash and Step5, the
# last in its own 1 KB rows; chunked local attention; Qwen4-exp's one-array
# PLE state; sliding-window WRITE): whatever the series holds, each is either
# refused at start with MoRIIO's own error or moves every byte right.
FAIL_CLOSED_OR_RIGHT = [
    ConfigItem("gemma", "write", 1, 1, "LBNHC"),
    ConfigItem("deepseek-v4.1-BLNHC", "read", 1, 1, "BLNHC"),
    ConfigItem("glm5next-BLNHC", "read", 1, 1, "BLNHC"),
    ConfigItem("step5-mtp", "read", 1, 1, "LBNHC"),
    ConfigItem("llama4", "write", 1, 1, "LBNHC"),
    ConfigItem("qwen4-exp-mtp", "read", 1, 1, "LBNHC"),
]
# Three KV heads cannot be split over two decode ranks: the decoder refuses
# its peer at the first handshake, naming the split, which refuses the
# configuration after that first case.
REFUSED = {
    ConfigItem("llama", "read", 1, 2, "LBNHC", kv_heads=3): "cannot split the 3",
}
FAULTS = {
    "shift-remote": ConfigItem("llama", "read", 1, 1, "LBNHC", fault="shift-remote"),
    "shift-local": ConfigItem("llama", "read", 1, 1, "BLNHC", fault="shift-local"),
    "swap-heads": ConfigItem("llama", "write", 1, 2, "LBNHC", fault="swap-heads"),
    "shift-remote-dcp": ConfigItem(
        "llama/dcp2", "read", 2, 2, "BLNHC", kv_heads=1, fault="shift-remote"
    ),
}


@pytest.fixture(scope="module")
def reports(byte_zygote: ZygoteSession) -> dict[ConfigItem, ConfigReport]:
    plan = [*SAMPLED, *FAIL_CLOSED_OR_RIGHT, *REFUSED, *FAULTS.values()]
    results = byte_zygote.run(plan, LENGTHS, HITS)
    return {r.item: r for r in results}


def _id(item: ConfigItem) -> str:
    return f"{item.layout}-{item.mode}-{item.p_tp}{item.d_tp}-{item.kv_layout}"


@pytest.mark.parametrize("item", SAMPLED, ids=_id)
def test_every_byte_the_decoder_attends_to_is_the_prefillers(reports, item):
    report = reports[item]
    assert report.refused_at_start is None and report.refused is None
    assert report.first_errors == []
    assert report.cases == report.planned == 10
    assert report.wrong_cases == 0, report.wrong_notes
    assert report.moved_bytes >= report.min_bytes > 0


@pytest.mark.parametrize("item", FAIL_CLOSED_OR_RIGHT, ids=_id)
def test_a_ring_or_chunked_group_fails_closed_or_moves_right(reports, item):
    report = reports[item]
    if report.refused_at_start is not None:
        assert "MoRIIO" in report.refused_at_start
        return
    assert report.refused is None and report.first_errors == []
    assert report.cases == report.planned == 10
    assert report.wrong_cases == 0, report.wrong_notes


@pytest.mark.parametrize("item", list(REFUSED), ids=_id)
def test_unsupported_pairs_fail_closed(reports, item):
    report = reports[item]
    assert report.refused_at_start is not None
    assert REFUSED[item] in report.refused_at_start
    assert report.cases == report.error_cases == 1
    assert report.wrong_cases == 0


@pytest.mark.parametrize("fault", ["shift-remote", "shift-remote-dcp"])
def test_a_shifted_source_offset_is_reported(reports, fault):
    report = reports[FAULTS[fault]]
    assert report.first_errors == []
    # A READ the shift takes past the prefiller's region fails: recomputed
    # where it loads asynchronously.
    assert report.wrong_cases + report.fallback_cases == report.cases == 10
    assert report.wrong_cases >= report.cases - 1
    assert report.stray_cases == 0


def test_a_shifted_destination_is_a_write_outside_the_destination_pages(reports):
    # A stray write of the bytes already there changes nothing and cannot be
    # seen (nor harm); recycled blocks make that possible in some cases.
    report = reports[FAULTS["shift-local"]]
    assert report.wrong_cases + report.fallback_cases == report.cases == 10
    assert report.wrong_cases >= report.cases - 1
    assert report.stray_cases >= report.cases // 2
    assert any("outside the destination pages" in n for n in report.wrong_notes)


def test_a_wrong_head_split_is_reported(reports):
    report = reports[FAULTS["swap-heads"]]
    assert report.first_errors == []
    assert report.wrong_cases == report.cases == 10
