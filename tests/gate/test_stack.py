"""A stack level's label names the patches it holds, in series order."""

from __future__ import annotations

from vllm_overlay.gate.stack import level_label
from vllm_overlay.series.patch_series import Series


def test_a_level_label_names_a_patch_out_of_number_order_alone(
    series: Series,
) -> None:
    numbers = [p.name.split("-", 1)[0] for p in series.patches]
    assert numbers[3:6] == ["0004", "0036", "0005"]
    assert level_label(series, 0) == "base"
    assert level_label(series, 1) == "base + 0001"
    assert level_label(series, 4) == "base + 0001..0004"
    assert level_label(series, 5) == "base + 0001..0004, 0036"
    assert level_label(series, 6) == "base + 0001..0004, 0036, 0005"
    assert level_label(series, len(numbers)).startswith("base + 0001..0004, 0036, 0005")
    assert level_label(series, len(numbers)).endswith(numbers[-1])
