"""The plan a simulate worker gets: parsed once, typed across the process
boundary (``simulate/plan.py``)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from vllm_overlay.simulate.plan import (
    OverlaySourceError,
    PlanItem,
    overlay_files,
    parse_hits,
    parse_lengths,
)

PINNED = ("moriio_connector.py", "moriio_engine.py", "moriio_tp_mapping.py")


def test_an_item_carries_parsed_values() -> None:
    item = PlanItem.of("llama", "1-5/2,17", "0,89.7", whole=True)
    assert item.lengths == (1, 3, 5, 17)
    assert item.hits == (0.0, 0.897)
    assert item.whole and item.fault is None and item.pair is None


def test_a_plan_crosses_the_process_as_it_was() -> None:
    plan = [PlanItem.of("kimi/dcp2", "529", "50"), PlanItem.of("gemma", "17", "0")]
    wire = msgspec.json.encode(plan)
    assert msgspec.json.decode(wire, type=list[PlanItem]) == plan


def test_lengths_as_text_are_refused_at_the_boundary() -> None:
    wire = b'[{"layout": "llama", "lengths": "17,529", "hits": [0.0]}]'
    with pytest.raises(msgspec.ValidationError, match="lengths"):
        msgspec.json.decode(wire, type=list[PlanItem])


@pytest.mark.parametrize(
    ("lengths", "hits", "says"),
    [
        ("0-4", "0", "a prompt length is at least 1"),
        ("5-2", "0", "a range a-b needs a <= b"),
        ("x", "0", "'x' is not a length"),
        ("17", "101", "a hit is 0 to 100 %"),
        ("17", "", "no hit given"),
    ],
)
def test_a_bad_value_says_why(lengths: str, hits: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        PlanItem.of("llama", lengths, hits)


def test_the_parsers() -> None:
    assert parse_lengths("3,1-2") == [1, 2, 3]
    assert parse_hits("50, 100") == [0.5, 1.0]


def test_an_overlay_directory_gives_every_file_the_pin_names(tmp_path: Path) -> None:
    # The series patches the engine and the TP mapping too: a build taken
    # from a directory carries them, not the installed ones.
    for name in PINNED:
        (tmp_path / name).write_text(f"# {name} as built\n")
    files, origin = overlay_files(dict.fromkeys(PINNED, "base"), str(tmp_path))
    assert files == {name: f"# {name} as built\n" for name in PINNED}
    assert origin == str(tmp_path)


def test_an_overlay_directory_missing_a_pinned_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / PINNED[0]).write_text("")
    with pytest.raises(OverlaySourceError, match="holds no moriio_engine.py"):
        overlay_files(dict.fromkeys(PINNED, "base"), str(tmp_path))
