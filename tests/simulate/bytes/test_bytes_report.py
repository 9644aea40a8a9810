"""The byte simulator's table: a refusal's cell keeps what it names."""

from __future__ import annotations

import pytest

from vllm_overlay.simulate.bytes.report import (
    REFUSAL_CHARS,
    BytesReport,
    ConfigItem,
    ConfigReport,
    cell,
    format_table,
)

STEP5 = ConfigItem("step5-mtp", "read", 1, 2, "LBNHC")
# A handshake refusal whose words hold a colon after the layer it names.
REFUSAL = (
    "MoRIIO READ cannot serve layer model.layers.3.summary_cache between "
    "prefill TP 1 and decode TP 2: its page is scaled up to the rank's page"
)


@pytest.mark.parametrize("prefix", ["", "MoRIIOError: ", "RuntimeError: "])
def test_a_refusal_cell_names_the_layer(prefix: str) -> None:
    text = cell(ConfigReport("overlay", STEP5, refused_at_start=prefix + REFUSAL))
    assert text.startswith("refused at start: MoRIIO READ cannot serve layer")
    assert "summary_cache" in text
    assert len(text) <= len("refused at start: ") + REFUSAL_CHARS


def test_a_refusal_in_every_case_is_cut_the_same() -> None:
    refused = ConfigReport("overlay", STEP5, cases=3, error_cases=3, refused=REFUSAL)
    assert cell(refused) == "refused: " + cell(
        ConfigReport("overlay", STEP5, refused_at_start=REFUSAL)
    ).removeprefix("refused at start: ")


def test_a_short_refusal_is_whole_in_the_table() -> None:
    refused = ConfigReport("overlay", STEP5, refused_at_start="ValueError: no ring")
    report = BytesReport([17], [0.0], {"overlay": "o"}, [refused], 1.0)
    assert "refused at start: no ring" in format_table(report)
    assert "ValueError" not in format_table(report)


def test_a_recomputed_case_shows_in_its_cell() -> None:
    write = ConfigItem("zaya", "write", 1, 2, "LBNHC")
    recomputed = ConfigReport("overlay", write, cases=2, fallback_cases=1)
    assert cell(recomputed).endswith("(1 recomputed)")
