"""Run vLLM's MoRIIO package from another directory inside this process.

Base and overlay side by side: a process calls ``use_moriio_dir(dir)`` before
anything imports ``moriio_connector``; the package's submodules then load
from ``dir`` (a directory holding ``moriio_connector.py`` etc., e.g. one
written by `vllm-overlay materialize`).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from vllm_overlay.errors import OverlayError

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"


class VariantError(OverlayError):
    """The moriio package was imported before it could be redirected."""


def use_moriio_dir(directory: Path) -> None:
    loaded = [m for m in sys.modules if m.startswith(PACKAGE + ".")]
    if loaded:
        raise VariantError(
            f"{loaded[0]} is already imported; redirect the package before "
            "importing any of its modules"
        )
    if not (directory / "moriio_connector.py").is_file():
        raise VariantError(f"{directory}: holds no moriio_connector.py")
    package = importlib.import_module(PACKAGE)
    package.__path__ = [str(directory)]
