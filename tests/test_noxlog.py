"""nox's `uv binary not found.` is left out of every session's log."""

from __future__ import annotations

import ast
import logging

import pytest

from tests.repo import REPO
from vllm_overlay.noxlog import UV_NOTE, drop_uv_note


def test_the_uv_note_is_dropped_and_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("nox-test")
    drop_uv_note(logger)
    drop_uv_note(logger)  # once is enough; twice adds nothing
    assert len(logger.filters) == 1
    with caplog.at_level(logging.INFO, logger="nox-test"):
        logger.info(UV_NOTE)
        logger.info("Running session dev")
    assert [r.getMessage() for r in caplog.records] == ["Running session dev"]


def test_the_noxfile_drops_it_from_noxs_logger() -> None:
    # nox is not installed where the tests run: read the noxfile.
    tree = ast.parse((REPO / "noxfile.py").read_text())
    calls = [
        ast.unparse(node.value)
        for node in tree.body
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
    ]
    assert "noxlog.drop_uv_note(logging.getLogger('nox'))" in calls
