"""The start-up line that says which overlay runs (a vLLM general plugin).

vLLM calls ``log_overlay`` in every process at start-up (entry point group
``vllm.general_plugins``). It reads the manifest `vllm-overlay apply` wrote
next to the MoRIIO files, checks the files still match it, and logs one line
through vLLM's own logger, so a server log proves what ran:

    vllm-moriio-overlay: series <id> (<patch ids>) on vLLM <version>

and, in a process whose command line configures MoRIIO (`vllm serve`'s
own; the config is not built yet when plugins load), the transfer mode:

    vllm-moriio-overlay: MoRIIO mode WRITE (read_mode unset: vLLM's default)
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.series.pin import MODULE_DIR, sha256_file
from vllm_overlay.tree.manifest import MANIFEST_NAME, read_manifest
from vllm_overlay.tree.moriio_mode import mode_line
from vllm_overlay.tree.target import installed_vllm

# A child of vLLM's "vllm" logger, so vLLM's handler and format apply.
logger = logging.getLogger("vllm.moriio_overlay")


def installed_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def overlay_line(vllm_dir: Path, vllm_version: str) -> tuple[int, str]:
    """The level and text of the banner for the vllm package at ``vllm_dir``."""
    root = vllm_dir.parent
    path = root / MODULE_DIR / MANIFEST_NAME
    manifest = read_manifest(path)
    if manifest is None:
        return logging.INFO, (
            f"vllm-moriio-overlay: no overlay manifest at {path}; the MoRIIO files "
            f"are vLLM {vllm_version}'s own (base) or unknown"
        )
    for rel, recorded in sorted(manifest.files.items()):
        file = root / rel
        actual = sha256_file(file) if file.is_file() else "missing"
        if actual != recorded.overlaid_sha256:
            return logging.WARNING, (
                f"vllm-moriio-overlay: {rel} does not match the manifest of series "
                f"{manifest.series_id} (sha256 {actual}); the MoRIIO files are unknown"
            )
    patches = ", ".join(n.removesuffix(".patch") for n in manifest.patch_names)
    return logging.INFO, (
        f"vllm-moriio-overlay: series {manifest.series_id} ({patches}) "
        f"on vLLM {vllm_version}"
    )


def log_overlay() -> None:
    """vLLM general plugin: log which overlay runs. Never raises."""
    try:
        level, text = overlay_line(installed_vllm(), installed_version())
    except (OSError, OverlayError) as e:
        level, text = logging.WARNING, f"vllm-moriio-overlay: cannot tell: {e}"
    logger.log(level, "%s", text)
    mode = mode_line(sys.argv, os.environ)
    if mode is not None:
        logger.log(mode[0], "%s", mode[1])
