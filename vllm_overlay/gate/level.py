"""A pytest plugin that runs the tests against one level of the stack.

``-p vllm_overlay.gate.level --moriio-dir DIR`` makes vLLM's MoRIIO package
load from ``DIR`` (a directory holding ``moriio_connector.py`` and the other
pinned files, e.g. written by ``vllm-overlay materialize --upto K``) before
any conftest or test module imports it. `nox -s unit-base` uses it to run a
patch's named tests on the stack below the patch and on the stack with it.
``--core-dir ROOT`` (a tree written by ``vllm-overlay materialize --core``)
loads the vLLM core modules it holds, ``ROOT/vllm/...``, in place of the
installed ones: a core patch's tests, and a workaround's tests with the core
fix that replaces it (``vllm-overlay removable``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_overlay.tree.variant import use_core_dir, use_moriio_dir

OPTION = "--moriio-dir"
CORE_OPTION = "--core-dir"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        default=None,
        type=Path,
        help="load vLLM's MoRIIO package from this directory",
    )
    parser.addoption(
        CORE_OPTION,
        default=None,
        type=Path,
        help="load the vLLM core modules this tree holds (ROOT/vllm/...)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before the initial conftests: tests/patches/conftest.py imports the
    # connector (through builders.py).
    core = early_config.known_args_namespace.core_dir
    if core is not None:
        use_core_dir(core.resolve())
    directory = early_config.known_args_namespace.moriio_dir
    if directory is not None:
        use_moriio_dir(directory.resolve())


def pytest_report_header(config: pytest.Config) -> list[str]:
    directory = config.getoption(OPTION)
    core = config.getoption(CORE_OPTION)
    lines = [f"moriio package: {directory}"] if directory is not None else []
    return lines + ([f"vLLM core modules: {core}"] if core is not None else [])
