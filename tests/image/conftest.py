"""Fixtures for the image tests: the pinned base files in a throwaway tree,
and overlay checkouts to apply onto it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.repo import REPO
from tests.workspace import header, make_diff
from vllm_overlay.series.patch_series import Series, load_series
from vllm_overlay.series.pin import MODULE_DIR, PIN_FILE
from vllm_overlay.tree.materialize import materialize

# Real image builds (root, a container engine, Debian's and PyPI's packages)
# run in `nox -s image-standin`, which sets this; not in the CPU suite.
if os.environ.get("VLLM_OVERLAY_IMAGE_BUILDS") != "1":
    collect_ignore = ["test_build_real.py"]
MODULE = MODULE_DIR
ENGINE = f"{MODULE}/moriio_engine.py"
COMMON = f"{MODULE}/moriio_common.py"


@pytest.fixture
def bases(base_texts: dict[str, str]) -> dict[str, str]:
    """The pinned base files (tests/conftest.py's ``base_texts``)."""
    return base_texts


@pytest.fixture
def one_patch_repo(tmp_path: Path, bases: dict[str, str]) -> Path:
    """A throwaway overlay checkout whose series is one small patch."""
    repo = tmp_path / "repo"
    (repo / "patches").mkdir(parents=True)
    shutil.copy(REPO / PIN_FILE, repo / PIN_FILE)
    old = bases[COMMON]
    new = old.replace("\nclass MoRIIOError(", "\n# Overlaid.\nclass MoRIIOError(", 1)
    assert new != old
    name = "0001-image-test.patch"
    (repo / "patches" / name).write_text(
        header("MoRIIO: image test", Tests="tests/image/test_apply_overlay.py")
        + "---\n"
        + make_diff(COMMON, old, new)
    )
    (repo / "patches" / "series").write_text(f"{name}\n")
    return repo


@pytest.fixture(params=["one-patch", "project"])
def overlay_repo(request: pytest.FixtureRequest, one_patch_repo: Path) -> Path:
    """An overlay checkout: the throwaway one, or this project's."""
    if request.param == "project":
        if not load_series(REPO).patches:
            pytest.skip("the project's series is empty right now")
        return REPO
    return one_patch_repo


@pytest.fixture
def series(overlay_repo: Path) -> Series:
    return load_series(overlay_repo)


@pytest.fixture
def site(tmp_path: Path, bases: dict[str, str]) -> Path:
    """A fake site-packages whose vllm holds only the pinned base files."""
    site = tmp_path / "site-packages"
    (site / "vllm" / "distributed").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    materialize(bases, Series(REPO, ()), site, overlay=False)
    return site
