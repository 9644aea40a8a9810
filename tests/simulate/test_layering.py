"""How the package is layered for ``simulate/``'s sake: every import of our
own modules at module level, anywhere in ``vllm_overlay`` (none hidden in a
function), and still neither ``--help`` nor a worker's start imports vLLM
before it chose its build."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.repo import REPO

PACKAGE = REPO / "vllm_overlay"


def _local_imports_of_ours(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if not node.level else ["vllm_overlay"]
            if any(name.startswith("vllm_overlay") for name in names):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_function_local_import_of_our_modules() -> None:
    found = [
        where
        for path in sorted(PACKAGE.rglob("*.py"))
        # the mori stand-in is a package of its own, loaded as ``mori``
        if "standin" not in path.parts
        for where in _local_imports_of_ours(path)
    ]
    # The e2e CLI's preflight: only that module reaches for vLLM, and nothing
    # imports it at module level (tests/e2e/test_install.py).
    assert found == ["vllm_overlay/e2e/cli.py:461"]


def test_the_check_finds_a_function_local_import(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    module.write_text(
        "import os\n"
        "from vllm_overlay.simulate import lines\n"
        "def f():\n"
        "    import json\n"
        "    from vllm_overlay.simulate import plan\n"
        "    return plan\n"
    )
    assert _local_imports_of_ours(module, tmp_path) == ["probe.py:5"]


@pytest.mark.parametrize(
    ("modules", "heavy"),
    [
        # what every `vllm-overlay` command loads, in lint's environment too
        # (no numpy, torch or vLLM there)
        (("vllm_overlay.cli",), ("vllm", "torch", "numpy")),
        # the workers, before they load their build
        (("vllm_overlay.simulate.worker",), ("vllm", "torch")),
        (("vllm_overlay.simulate.bytes.zygote",), ("vllm", "torch")),
    ],
)
def test_importing_does_not_import_vllm(
    modules: tuple[str, ...], heavy: tuple[str, ...]
) -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "[]"
