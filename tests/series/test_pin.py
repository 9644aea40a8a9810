"""The pin decodes with validation; a bad pin names the bad field."""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec
import pytest

from tests.repo import REPO
from vllm_overlay.series.pin import PinError, decode_pin, encode_pin, load_pin
from vllm_overlay.tree.materialize import MaterializeError, base_from_wheel

PIN_TEXT = (REPO / "pin.toml").read_text()
VERSION = load_pin(REPO / "pin.toml").vllm.version
GIT_COMMIT = load_pin(REPO / "pin.toml").vllm.git_commit


def test_repo_pin_round_trips() -> None:
    pin = load_pin(REPO / "pin.toml")
    assert pin.vllm.wheel.startswith(f"vllm-{pin.vllm.version}-")
    assert re.fullmatch(r"[0-9a-f]{7,40}", pin.vllm.git_commit)
    assert pin.image.reference.endswith(f":v{pin.vllm.version}")
    assert all(p.startswith(pin.module + "/") for p in pin.files)
    assert decode_pin(encode_pin(pin)) == pin
    assert pin.core_files and not set(pin.core_files) & set(pin.files)


def test_a_pin_without_core_files_writes_none() -> None:
    pin = load_pin(REPO / "pin.toml")
    bare = msgspec.structs.replace(pin, core_files={})
    assert "core_files" not in encode_pin(bare)
    assert decode_pin(encode_pin(bare)) == bare


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (
            lambda t: t.replace(f'git_commit = "{GIT_COMMIT}"', 'git_commit = "xyz"'),
            "$.vllm.git_commit",
        ),
        (lambda t: t.replace(f'version = "{VERSION}"\n', ""), "version"),
        (lambda t: t.replace("[image]", "[imaje]"), "imaje"),
        (lambda t: t.replace('= "e3b0c442', '= "E3B0C442'), "$.files"),
        (
            lambda t: t.replace(
                "[files]", '[files]\n"vllm/other.py" = "' + "0" * 64 + '"'
            ),
            "outside module",
        ),
        (
            lambda t: t.replace(
                "[core_files]", '[core_files]\n"other/x.py" = "' + "0" * 64 + '"'
            ),
            "not a normalised path below vllm/",
        ),
        (
            lambda t: t.replace(
                "[core_files]",
                '[core_files]\n"vllm/distributed/kv_transfer/kv_connector/v1/moriio/'
                'x.py" = "' + "0" * 64 + '"',
            ),
            "is in module",
        ),
    ],
)
def test_bad_pin_names_the_field(edit, field: str) -> None:
    with pytest.raises(PinError) as exc:
        decode_pin(edit(PIN_TEXT), "pin.toml")
    assert field in str(exc.value)
    assert str(exc.value).startswith("pin.toml: invalid pin")


def test_not_toml() -> None:
    with pytest.raises(PinError, match="not valid TOML"):
        decode_pin("[vllm\n", "pin.toml")


def test_missing_pin(tmp_path: Path) -> None:
    with pytest.raises(PinError, match="cannot read pin"):
        load_pin(tmp_path / "pin.toml")


def _wheel() -> Path:
    value = os.environ.get("VLLM_OVERLAY_WHEEL")
    if not value:
        pytest.fail(
            "VLLM_OVERLAY_WHEEL is not set: run the tests with `nox -s unit`, "
            "which downloads the pinned wheel"
        )
    return Path(value)


def test_wheel_files_match_the_pin() -> None:
    pin = load_pin(REPO / "pin.toml")
    bases = base_from_wheel(_wheel(), pin)
    assert set(bases) == set(pin.files)


def test_wrong_wheel_is_refused(tmp_path: Path) -> None:
    pin = load_pin(REPO / "pin.toml")
    fake = tmp_path / pin.vllm.wheel
    fake.write_bytes(b"PK")
    with pytest.raises(MaterializeError, match=pin.vllm.wheel_sha256):
        base_from_wheel(fake, pin)
