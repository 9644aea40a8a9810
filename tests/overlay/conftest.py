"""Fixtures for the overlay machinery: real base files, throwaway trees.

The base files come from the vLLM installed in the test environment (peeled
back to the pinned base when that install is overlaid), so every test here
runs against the exact bytes the series is made for.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.overlay.workspace import REPO, Workspace
from vllm_overlay.series.pin import PIN_FILE, Pin


@pytest.fixture
def ws(tmp_path: Path, pin: Pin, base_texts: dict[str, str]) -> Workspace:
    repo = tmp_path / "repo"
    (repo / "patches").mkdir(parents=True)
    shutil.copy(REPO / PIN_FILE, repo / PIN_FILE)
    (repo / "patches" / "series").write_text("# test series\n")
    (repo / "tests" / "overlay").mkdir(parents=True)
    (repo / "tests" / "overlay" / "conftest.py").write_text("")
    site = tmp_path / "site-packages"
    (site / "vllm" / "distributed").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    for path, text in base_texts.items():
        dest = site / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    return Workspace(repo, site, dict(base_texts))
