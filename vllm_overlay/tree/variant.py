"""Run vLLM's MoRIIO package from another directory inside this process.

Base and overlay side by side: ``build_variant_dir`` writes a complete
moriio package directory (the installed modules, with the files the series
touches replaced), and a process calls ``use_moriio_dir(dir)`` before
anything imports ``moriio_connector``; the package's submodules then load
from ``dir``.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import sys
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.series.pin import MODULE_PACKAGE

# The connector and its common module, by file name (tests build variants
# replacing them; a simulated build replaces every file the pin names).
MORIIO_FILES = ("moriio_connector.py", "moriio_common.py")


class VariantError(OverlayError):
    """The moriio package was imported before it could be redirected."""


def use_moriio_dir(directory: Path) -> None:
    loaded = [m for m in sys.modules if m.startswith(MODULE_PACKAGE + ".")]
    if loaded:
        raise VariantError(
            f"{loaded[0]} is already imported; redirect the package before "
            "importing any of its modules"
        )
    if not (directory / "moriio_connector.py").is_file():
        raise VariantError(f"{directory}: holds no moriio_connector.py")
    package = importlib.import_module(MODULE_PACKAGE)
    package.__path__ = [str(directory)]


def installed_moriio_dir() -> Path:
    """The installed package's directory, found without importing vLLM
    (``find_spec`` of a submodule imports its parents: seconds)."""
    top, *rest = MODULE_PACKAGE.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise VariantError(f"this Python has no {top}")
    directory = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
    if not (directory / "__init__.py").is_file():
        raise VariantError(f"this Python has no {MODULE_PACKAGE} ({directory})")
    return directory


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
