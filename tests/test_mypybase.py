"""Telling the series' mypy errors from the pinned base's."""

from __future__ import annotations

from vllm_overlay.mypybase import MypyError, errors_of_ours, parse_errors

CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
# The shape of mypy's report on the pinned base's moriio_connector.py with
# vLLM's settings (two of its eight errors).
BASE = (
    f'{CONNECTOR}:941: error: Need type annotation for "ctx"  [var-annotated]\n'
    f"{CONNECTOR}:2797: error: Unsupported operand types for / "
    '("None" and "int")  [operator]\n'
    f'{CONNECTOR}:2797: note: Left operand is of type "int | None"\n'
    "Found 2 errors in 1 file (checked 2 source files)\n"
)


def test_errors_are_read_without_their_line_numbers() -> None:
    assert parse_errors(BASE) == [
        MypyError(CONNECTOR, "var-annotated", 'Need type annotation for "ctx"'),
        MypyError(
            CONNECTOR, "operator", 'Unsupported operand types for / ("None" and "int")'
        ),
    ]
    assert str(parse_errors(BASE)[0]).endswith(" [var-annotated]")


def test_the_base_errors_moved_by_the_series_are_not_ours() -> None:
    moved = BASE.replace(":941:", ":1003:").replace(":2797:", ":3417:")
    assert errors_of_ours(parse_errors(BASE), parse_errors(moved)) == []


def test_a_new_error_and_one_more_of_a_base_error_are_ours() -> None:
    extra = (
        f'{CONNECTOR}:3075: error: Need type annotation for "ctx"  [var-annotated]\n'
        f'{CONNECTOR}:12: error: Name "x" is not defined  [name-defined]\n'
    )
    ours = errors_of_ours(parse_errors(BASE), parse_errors(BASE + extra))
    assert ours == [
        MypyError(CONNECTOR, "var-annotated", 'Need type annotation for "ctx"'),
        MypyError(CONNECTOR, "name-defined", 'Name "x" is not defined'),
    ]
