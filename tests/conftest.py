"""Fixtures every test directory may use: the pin and the real base files.

The base files are the pinned vLLM's, taken from the pinned wheel when the
run has it, else from the vLLM installed in the test environment (peeled back
to the base when that install is overlaid), so tests run against the exact
bytes the series is made for.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from tests.repo import REPO
from tests.workspace import Workspace, fake_site
from vllm_overlay.series.patch_series import Series, load_series
from vllm_overlay.series.pin import PIN_FILE, Pin, load_pin
from vllm_overlay.tree.materialize import base_from_target
from vllm_overlay.tree.target import detect_target, installed_vllm

# A property test is meant to fail on the stack below its patch. There
# `--hypothesis-profile=gate` (the base and stack-level runs of
# `nox -s unit-base`) reports the first failing example instead of shrinking
# it, which takes minutes on this machine.
settings.register_profile(
    "gate", phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target)
)


@pytest.fixture(scope="session")
def repo() -> Path:
    """The checkout under test (its root)."""
    return REPO


@pytest.fixture(scope="session")
def pin() -> Pin:
    return load_pin(REPO / PIN_FILE)


@pytest.fixture(scope="session")
def pin_text() -> str:
    """The checkout's pin.toml, as text."""
    return (REPO / PIN_FILE).read_text()


@pytest.fixture(scope="session")
def series() -> Series:
    """The checkout's patch series."""
    return load_series(REPO)


@pytest.fixture(scope="session")
def base_texts(pin: Pin) -> dict[str, str]:
    """The pinned base files: from the pinned wheel when the run has it
    ($VLLM_OVERLAY_WHEEL, each file checked against the pin), so that a test
    using them reads nothing of the installed tree (the gate would count
    that read and run the test on the base too); else recovered from the
    installed tree."""
    wheel = os.environ.get("VLLM_OVERLAY_WHEEL")
    if wheel and Path(wheel).is_file():
        return _pinned_files(Path(wheel), pin)
    target = detect_target(installed_vllm())
    return base_from_target(target, pin, load_series(REPO))


def _pinned_files(wheel: Path, pin: Pin) -> dict[str, str]:
    texts = {}
    with zipfile.ZipFile(wheel) as zf:
        for path, sha in pin.files.items():
            data = zf.read(path)
            assert hashlib.sha256(data).hexdigest() == sha, f"{wheel}!{path}"
            texts[path] = data.decode()
    return texts


@pytest.fixture
def ws(tmp_path: Path, pin: Pin, base_texts: dict[str, str]) -> Workspace:
    """A throwaway overlay checkout with an empty series, and a fake
    site-packages whose vLLM holds the pinned base files."""
    repo = tmp_path / "repo"
    (repo / "patches").mkdir(parents=True)
    shutil.copy(REPO / PIN_FILE, repo / PIN_FILE)
    (repo / "patches" / "series").write_text("# test series\n")
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "conftest.py").write_text("")
    site = fake_site(tmp_path / "site-packages", base_texts)
    return Workspace(repo, site, dict(base_texts))
