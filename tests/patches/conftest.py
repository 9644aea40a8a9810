"""Fixtures for the per-patch tests: local model folders (config.json only).

The builders they use live in ``builders.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.patches.builders import (
    TINY_DEEPSEEK_MTP_CONFIG,
    TINY_LLAMA_CONFIG,
    write_model_dir,
)


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("llama"), TINY_LLAMA_CONFIG)


@pytest.fixture(scope="session")
def deepseek_mtp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(
        tmp_path_factory.mktemp("deepseek_mtp"), TINY_DEEPSEEK_MTP_CONFIG
    )
