"""Helpers for the export and rebase tests: patch texts, throwaway vLLM
trees and wheel-shaped zips (the fixtures are in conftest.py)."""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

from vllm_overlay.series.diff import unified_diff
from vllm_overlay.series.pin import MODULE_DIR

REPO = Path(__file__).resolve().parents[2]
MODULE = MODULE_DIR
CONNECTOR = f"{MODULE}/moriio_connector.py"
COMMON = f"{MODULE}/moriio_common.py"
OLD_WHEEL_ENV = "VLLM_OVERLAY_TEST_OLD_WHEEL"
# Lines of the base connector test patches edit around, and what upstream
# adds at the top of a newer base.
CLAMP = (
    '    def _clamp_to_prompt_blocks(self, req: "Request", block_ids: BlockIds)'
    " -> BlockIds:\n"
)
CLAMP_NEW = (
    CLAMP + "        # Overlay test: blocks past the prompt are never transferred.\n"
)
SPDX = "# SPDX-License-Identifier: Apache-2.0\n"
INSERTED = "".join(f"# upstream line {i}\n" for i in range(7))


def header(subject: str, tests: str = "tests/patches/test_x.py::test_x") -> str:
    return (
        f"Description: [Bugfix][ROCm][KVConnector] MoRIIO: {subject}\n"
        f" {subject}.\n"
        " Root cause: the test needs one.\n"
        " .\n"
        " Changes: one line.\n"
        "Origin: vendor\n"
        "Author: overlay-tests\n"
        "Forwarded: no\n"
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


# A release newer than any pin this series will see, and its wheel's name.
NEWER = "0.99.0"
NEWER_WHEEL = f"vllm-{NEWER}-cp38-abi3-manylinux_2_28_x86_64.whl"


def inserted_above(text: str) -> str:
    """``text`` as a newer upstream holds it: ``INSERTED`` added at the top,
    below the SPDX line (so that every hunk below moves by an offset)."""
    return edit(text, SPDX, SPDX + INSERTED)


def newer_wheel(tmp_path: Path, files: Mapping[str, str]) -> Path:
    """A wheel of release ``NEWER`` holding ``files``, in ``tmp_path``."""
    return write_wheel(tmp_path / NEWER_WHEEL, files, NEWER, "0a1b2c3d4")


def rebase_argv(
    root: Path,
    to: Path,
    tmp_path: Path,
    old: Mapping[str, str] | None = None,
    *,
    report: bool = False,
) -> list[str]:
    """``--repo ROOT rebase --to TO`` working in ``tmp_path/work``: from a
    source tree holding ``old`` when given, writing its report to
    ``tmp_path/r.json`` when ``report``."""
    argv = ["--repo", str(root), "rebase", "--to", str(to)]
    if old is not None:
        argv += ["--from", str(write_tree(tmp_path / "old", old))]
    argv += ["--workdir", str(tmp_path / "work")]
    if report:
        argv += ["--report", str(tmp_path / "r.json")]
    return argv
