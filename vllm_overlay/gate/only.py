"""A pytest plugin that runs only the listed test ids.

``-p vllm_overlay.gate.only --only-ids FILE`` (one test id a line): the base
run of `nox -s unit-base` runs the tests its evidence selects, each shard
from its own files. A listed test that runs nowhere has no base outcome,
which `vllm-overlay revert-red --touches` fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

OPTION = "--only-ids"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(OPTION, default=None, type=Path, help="run only these test ids")


def read_ids(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    path = config.getoption(OPTION)
    if path is None:
        return
    wanted = set(read_ids(path))
    keep = [item for item in items if item.nodeid in wanted]
    dropped = [item for item in items if item.nodeid not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
