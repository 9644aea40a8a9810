"""A stack level's label names the patches it holds, in series order; the
level server loads what the levels' tests import, but the MoRIIO package."""

from __future__ import annotations

from pathlib import Path

from vllm_overlay.gate.stack import level_label, preload_names
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


def test_the_level_server_loads_the_third_party_modules_of_the_named_tests(
    tmp_path: Path,
) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text("import hypothesis\n")
    (tmp_path / "tests" / "test_x.py").write_text(
        "from vllm.v1.request import Request\nimport numpy\n"
    )
    bases = {"moriio_connector.py": "import msgspec\nfrom vllm.config import X\n"}
    names = preload_names(tmp_path, bases, ["tests/test_x.py::test_a"])
    assert names[:2] == ["vllm.config", "vllm.v1.request"]
    assert {"hypothesis", "numpy", "msgspec"} <= set(names)
