"""A variant's moriio directory starts from the installed package, found
without importing vLLM: the sweeps find it before any simulator process
starts, and importing vLLM there cost every sweep seconds on its critical
path."""

from __future__ import annotations

import subprocess
import sys

from vllm_overlay.series.pin import MODULE_PACKAGE
from vllm_overlay.tree.variant import MORIIO_FILES, build_variant_dir


def test_the_installed_package_is_found_without_importing_vllm():
    code = (
        "import sys, importlib.util\n"
        "from vllm_overlay.tree.variant import installed_moriio_dir\n"
        "found = installed_moriio_dir()\n"
        "assert 'vllm' not in sys.modules, sorted(sys.modules)[:5]\n"
        f"spec = importlib.util.find_spec({MODULE_PACKAGE!r})\n"
        "assert [str(found)] == list(spec.submodule_search_locations), found\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_variant_dir_is_the_package_with_the_files_replaced(tmp_path):
    dest = build_variant_dir(tmp_path / "moriio", {MORIIO_FILES[1]: "X = 1\n"})
    assert (dest / "__init__.py").is_file()
    assert (dest / MORIIO_FILES[1]).read_text() == "X = 1\n"
    assert "class MoRIIOConnector" in (dest / MORIIO_FILES[0]).read_text()
