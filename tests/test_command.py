"""The output every command shares: nothing it prints can fail on the
stream's encoding (issue 41: an apply that had done its work ended in
`internal error: UnicodeEncodeError`, exit 2)."""

from __future__ import annotations

import io
import json

import msgspec
import pytest

from vllm_overlay.command import App


class Result(msgspec.Struct):
    name: str
    files: list[str]


def _stream(encoding: str) -> tuple[io.BytesIO, io.TextIOWrapper]:
    raw = io.BytesIO()
    return raw, io.TextIOWrapper(raw, encoding=encoding, errors="strict")


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_text_with_undecodable_and_non_ascii_names_is_escaped(encoding: str) -> None:
    raw, out = _stream(encoding)
    App(stdout=out).say("wrote moriio_\udcff.py and caf\u00e9.py")
    out.flush()
    text = raw.getvalue().decode(encoding)
    assert text.startswith("wrote moriio_\\xff.py and caf")
    assert text.endswith(".py\n")


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_json_with_undecodable_and_non_ascii_names_stays_json(encoding: str) -> None:
    raw, out = _stream(encoding)
    value = Result("caf\u00e9 \U0001f600", ["moriio_\udcff.py"])
    App(json=True, stdout=out).result(value)
    decoded = json.loads(raw.getvalue().decode(encoding))
    assert decoded == {"name": "caf\u00e9 \U0001f600", "files": ["moriio_\\xff.py"]}
