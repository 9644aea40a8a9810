"""The harness installs light (defect 8): `pip install .` into a bare venv
gives a working `vllm-overlay e2e --help` and dry run, without vLLM or torch;
everything the e2e package imports is declared in pyproject.toml."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from tests.e2e.conftest import EXAMPLES, REPO

E2E = REPO / "vllm_overlay" / "e2e"
# Imported only by the harness run itself, found with a clear error if missing.
RUN_ONLY = {"tokenizers"}


def third_party_imports(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {
        n for n in names if n not in sys.stdlib_module_names and n != "vllm_overlay"
    }


def test_every_e2e_import_is_declared() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {
        d.split(">")[0].split("=")[0].strip().replace("-", "_")
        for d in project["dependencies"]
    }
    extra = {
        d.split(">")[0].split("=")[0].strip().replace("-", "_")
        for d in project["optional-dependencies"]["e2e"]
    }
    used = third_party_imports(sorted(E2E.glob("*.py")))
    assert used - RUN_ONLY <= core, used - core
    assert extra >= RUN_ONLY
    assert not {"vllm", "torch"} & (core | extra)


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with pip only, and this checkout installed (not editable)."""
    root = tmp_path_factory.mktemp("bare")
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    # A copy of the checkout's package files, so the build leaves no egg-info
    # or build/ directory in the working tree.
    src = root / "src"
    files = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--cached", "--others",
         "--exclude-standard", "pyproject.toml", "README.md", "vllm_overlay"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for rel in files:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((REPO / rel).read_bytes())
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         str(src)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return python


def test_help_and_dry_run_in_a_bare_venv(bare_venv: Path, tmp_path: Path) -> None:
    cli = bare_venv.parent / "vllm-overlay"
    help_ = subprocess.run([str(cli), "e2e", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0, help_.stderr
    assert "--launcher {ssh,slurm,attach}" in help_.stdout
    # The dry run computes the plan and the expected failures with no vLLM.
    config = EXAMPLES / "dsv4-pro-1p1d.toml"
    dry = subprocess.run(
        [str(cli), "e2e", "--config", str(config), "--dry-run"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "lookahead-shift" in dry.stdout
    listed = subprocess.run(
        [str(bare_venv), "-m", "pip", "list", "--format", "freeze"],
        capture_output=True, text=True, check=True,
    ).stdout.lower()  # fmt: skip
    assert "torch" not in listed and "vllm==" not in listed


def test_a_run_without_tokenizers_says_what_to_install(
    bare_venv: Path, tmp_path: Path
) -> None:
    cli = bare_venv.parent / "vllm-overlay"
    run = subprocess.run(
        [str(cli), "e2e", "--config", str(EXAMPLES / "llama-smoke.toml"),
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2
    assert "pip install 'vllm-moriio-overlay[e2e]'" in run.stderr
    assert "Traceback" not in run.stderr
