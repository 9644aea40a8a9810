"""Write a complete moriio package directory for one variant.

``vllm_overlay.tree.variant.use_moriio_dir`` replaces the package's search path,
so the directory holds every module: the installed ones, with the two files
the series touches replaced.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

MORIIO_PKG = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
MORIIO_FILES = ("moriio_connector.py", "moriio_common.py")


def installed_moriio_dir() -> Path:
    spec = importlib.util.find_spec(MORIIO_PKG)
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def build_variant_dir(dest: Path, overlay_files: dict[str, str] | None) -> Path:
    """Copy the installed moriio package to ``dest`` and overwrite files.

    ``overlay_files`` maps a file name (e.g. ``moriio_connector.py``) to its
    text; ``None`` keeps the installed (base) files.
    """
    src = installed_moriio_dir()
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in (overlay_files or {}).items():
        (dest / name).write_text(text)
    return dest
