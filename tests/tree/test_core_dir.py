"""`materialize --core cNNN` and `use_core_dir`: a tree holding the MoRIIO
files and the core files with the core series applied, whose core modules
load in place of the installed ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_overlay.cli import main
from vllm_overlay.series.pin import Pin
from vllm_overlay.tree.variant import VariantError, core_modules, use_core_dir

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
CORE_MODULES = [
    "vllm.models.deepseek_v41.compressor",
    "vllm.models.glm5next.common.attention",
    "vllm.models.qwen4_exp.common.qsa_indexer",
    "vllm.models.step5.common.csa_tail_ring",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.request",
]
FIXED = "if num_external_computed_tokens and self.connector is not None"


@pytest.fixture(scope="module")
def core_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("core") / "tree"
    assert main(["materialize", "--core", "c001", "--out", str(out)]) == 0
    return out


def test_materialize_core_writes_the_patched_core_files(
    core_tree: Path, pin: Pin, capsys: pytest.CaptureFixture[str]
) -> None:
    assert FIXED in (core_tree / SCHEDULER).read_text()
    # Core patches above c001 stay off: every core file is written, c002's base.
    manager = (core_tree / "vllm/v1/core/kv_cache_manager.py").read_text()
    assert "cdiv(num_computed_tokens, spec.block_size)" in manager
    assert all((core_tree / path).is_file() for path in pin.files)


def test_materialize_without_core_writes_no_core_file(tmp_path: Path) -> None:
    assert main(["materialize", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / SCHEDULER).exists()


def test_an_unknown_core_patch_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["materialize", "--core", "c009", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no core patch c009" in err
    assert not any(tmp_path.iterdir())


def test_core_modules_leave_the_moriio_package_out(core_tree: Path) -> None:
    assert list(core_modules(core_tree)) == CORE_MODULES


def test_the_core_modules_load_from_the_tree(core_tree: Path) -> None:
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from vllm_overlay.tree.variant import use_core_dir\n"
        "print(use_core_dir(Path(sys.argv[1])))\n"
        "import vllm.v1.core.sched.scheduler as s\n"
        "print(s.__file__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(core_tree)],
        capture_output=True,
        text=True,
        check=True,
    )
    names, file = done.stdout.strip().splitlines()[-2:]
    assert names == str(CORE_MODULES)
    assert file == str(core_tree / SCHEDULER)


def test_a_tree_without_core_modules_is_refused(tmp_path: Path) -> None:
    with pytest.raises(VariantError, match="holds no vLLM core module"):
        use_core_dir(tmp_path)


def test_a_core_module_already_imported_is_refused(core_tree: Path) -> None:
    import vllm.v1.core.sched.scheduler  # noqa: F401

    with pytest.raises(VariantError, match="already imported"):
        use_core_dir(core_tree)
