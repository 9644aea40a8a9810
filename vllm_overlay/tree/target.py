"""Where vLLM lives: an installed package directory or a source checkout."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from vllm_overlay.errors import OverlayError
from vllm_overlay.series.pin import MODULE_DIR


class TargetError(OverlayError):
    """The path given is not a vLLM tree."""


@dataclass(frozen=True)
class Target:
    # The directory holding the `vllm` package: site-packages for an
    # installed vLLM, the checkout for a source tree.
    root: Path
    # "files": only the MoRIIO module below vllm/, as `materialize` writes it.
    kind: Literal["installed", "source", "files"]
    # The module directory, resolved once (`apply` sets it): every path
    # below the module is taken from there, even if a symlink on the way to
    # it changes meanwhile.
    module_real: Path | None = None

    def file(self, rel: str) -> Path:
        prefix = MODULE_DIR + "/"
        if self.module_real is not None and rel.startswith(prefix):
            return self.module_real / rel[len(prefix) :]
        return self.root / rel

    def module_dir(self) -> Path:
        """The MoRIIO module's directory (resolved, when ``module_real`` is)."""
        return self.module_real or self.root / MODULE_DIR

    def resolve_module(self) -> Target:
        """This target with its module directory resolved once (it must
        exist): a symlink on the way is followed now, and only now."""
        module_dir = self.root / MODULE_DIR
        if not module_dir.is_dir():
            raise TargetError(f"{self.describe()}: has no {MODULE_DIR}")
        return replace(self, module_real=module_dir.resolve(strict=True))

    def describe(self) -> str:
        what = {
            "installed": "installed package",
            "source": "source tree",
            "files": "MoRIIO files only",
        }[self.kind]
        return f"{self.root / 'vllm'} ({what})"


def _is_vllm_package(path: Path) -> bool:
    return (path / "__init__.py").is_file() and (path / "distributed").is_dir()


def _holds_module_only(root: Path) -> bool:
    """``root`` holds ``vllm/<MoRIIO module>`` and not a whole vllm package:
    a directory `vllm-overlay materialize` wrote."""
    return (root / MODULE_DIR).is_dir() and not (root / "vllm" / "__init__.py").exists()


def detect_target(path: Path) -> Target:
    """Accept ``.../site-packages/vllm``, a vLLM source root, or a directory
    `materialize` wrote (its root or its ``vllm/``)."""
    path = path.resolve()
    if not path.is_dir():
        raise TargetError(f"{path}: no such directory")
    if path.name == "vllm" and _is_vllm_package(path):
        parent = path.parent
        source = any((parent / n).exists() for n in ("setup.py", "pyproject.toml"))
        return Target(parent, "source" if source else "installed")
    if _is_vllm_package(path / "vllm"):
        source = any((path / n).exists() for n in ("setup.py", "pyproject.toml"))
        return Target(path, "source" if source else "installed")
    if _holds_module_only(path):
        return Target(path, "files")
    if path.name == "vllm" and _holds_module_only(path.parent):
        return Target(path.parent, "files")
    raise TargetError(
        f"{path}: neither an installed vllm package directory "
        "(…/site-packages/vllm), a vLLM source root (a directory holding vllm/), "
        f"nor a directory holding {MODULE_DIR} (`vllm-overlay materialize --out`)"
    )


def installed_vllm() -> Path:
    """The ``vllm`` package directory of this interpreter, without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise TargetError("no vllm package is installed in this Python environment")
    return Path(next(iter(spec.submodule_search_locations)))
