"""``--core``: run the simulators' legs on vLLM with the core series applied.

The core series (``patches/core/``) is upstream-only: the image never ships
it. With ``--core`` each simulator process loads the core files, every core
patch applied, in place of the installed ones (``tree.variant.use_core_dir``),
so the families' specs and the connector see what a vLLM carrying those
fixes gives them. The parent writes the tree once and names it to its
children in ``CORE_ENV``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vllm_overlay.checkout import Checkout
from vllm_overlay.series.core_series import core_key, load_core_series
from vllm_overlay.series.patch_series import Series
from vllm_overlay.tree.materialize import BaseSource, core_texts, materialize
from vllm_overlay.tree.variant import use_core_dir

CORE_ENV = "VLLM_OVERLAY_SIMULATE_CORE_DIR"
"""Set in a child's environment to the core tree its vLLM loads."""


@contextlib.contextmanager
def core_tree(source: BaseSource, checkout: Checkout) -> Iterator[str]:
    """Write the core files with the whole core series applied into a
    temporary directory, name it in ``CORE_ENV`` for the children started
    meanwhile, and yield what was applied (``c001..c005``); both go
    afterwards."""
    core = load_core_series(checkout.root)
    keys = [core_key(p) for p in core.patches]
    texts = core_texts(source.load_core(checkout.pin), core)
    root = Path(tempfile.mkdtemp(prefix="vllm-overlay-core-"))
    previous = os.environ.get(CORE_ENV)
    try:
        materialize(texts, Series(checkout.root, ()), root)
        os.environ[CORE_ENV] = str(root)
        yield f"{keys[0]}..{keys[-1]}" if keys else "no core patch"
    finally:
        if previous is None:
            os.environ.pop(CORE_ENV, None)
        else:
            os.environ[CORE_ENV] = previous
        shutil.rmtree(root, ignore_errors=True)


def load_core_from_env() -> bool:
    """In a child, before vLLM is imported: load the core modules of the
    tree ``CORE_ENV`` names, if any. Returns whether it did."""
    root = os.environ.get(CORE_ENV)
    if not root:
        return False
    use_core_dir(Path(root))
    return True
