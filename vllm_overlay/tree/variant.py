"""Run vLLM's MoRIIO package from another directory inside this process.

Base and overlay side by side: ``build_variant_dir`` writes a complete
moriio package directory (the installed modules, with the files the series
touches replaced), and a process calls ``use_moriio_dir(dir)`` before
anything imports ``moriio_connector``; the package's submodules then load
from ``dir``. ``use_core_dir(root)`` does the same for the vLLM core modules
a tree materialized with core patches holds (``root/vllm/...``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from vllm_overlay.errors import OverlayError
from vllm_overlay.series.pin import MODULE_DIR, MODULE_PACKAGE

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


class _CoreFinder(importlib.abc.MetaPathFinder):
    """Finds the named vLLM modules in their materialized files."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        found = self.files.get(fullname)
        if found is None:
            return None
        return importlib.util.spec_from_file_location(fullname, found)


def core_modules(root: Path) -> dict[str, Path]:
    """The vLLM modules below ``root/vllm`` (a materialized tree), by name;
    the MoRIIO package aside (``use_moriio_dir`` loads it)."""
    moriio = root / MODULE_DIR
    out: dict[str, Path] = {}
    for path in sorted((root / "vllm").rglob("*.py")):
        if path.is_relative_to(moriio) or path.name == "__init__.py":
            continue
        rel = path.relative_to(root).with_suffix("")
        out[".".join(rel.parts)] = path
    return out


def use_core_dir(root: Path) -> list[str]:
    """Load the vLLM core modules ``root`` holds (``root/vllm/v1/...``, as
    ``materialize --core`` writes them) in place of the installed ones;
    returns their names. Call it before vLLM imports any of them."""
    files = core_modules(root)
    if not files:
        raise VariantError(f"{root}: holds no vLLM core module below vllm/")
    loaded = [m for m in files if m in sys.modules]
    if loaded:
        raise VariantError(
            f"{loaded[0]} is already imported; load the core modules from "
            f"{root} before importing vLLM"
        )
    sys.meta_path.insert(0, _CoreFinder(files))
    return sorted(files)


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
