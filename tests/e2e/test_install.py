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
# The preflight's vLLM side: the only module that imports vLLM, only inside
# its functions; the CLI calls it where vLLM is importable, else runs it in
# the Python that has vLLM (cli.run_preflight).
PREFLIGHT_VLLM = E2E / "preflight_vllm.py"
VLLM = {"vllm", "torch"}


def _names(nodes: list[ast.AST]) -> set[str]:
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {
        n for n in names if n not in sys.stdlib_module_names and n != "vllm_overlay"
    }


def third_party_imports(paths: list[Path]) -> set[str]:
    return _names([n for p in paths for n in ast.walk(ast.parse(p.read_text()))])


def module_level_nodes(path: Path) -> list[ast.AST]:
    """The nodes run when ``path`` is imported (not those inside functions)."""
    tree = ast.parse(path.read_text())
    inner = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for n in ast.walk(f)
    }
    return [n for n in ast.walk(tree) if id(n) not in inner]


def test_only_the_preflight_imports_vllm_and_only_when_it_runs() -> None:
    others = [p for p in sorted(E2E.glob("*.py")) if p != PREFLIGHT_VLLM]
    assert not VLLM & third_party_imports(others)
    assert third_party_imports([PREFLIGHT_VLLM]) >= VLLM
    assert not VLLM & _names(module_level_nodes(PREFLIGHT_VLLM))
    # Nothing imports it at module level either.
    for path in others:
        modules = {
            n.module
            for n in module_level_nodes(path)
            if isinstance(n, ast.ImportFrom) and n.module
        }
        assert "vllm_overlay.e2e.preflight_vllm" not in modules, path


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
    used = third_party_imports(sorted(E2E.glob("*.py"))) - VLLM
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
