"""A pytest plugin that keeps a shard's test files out of a collection of
whole directories.

``-p vllm_overlay.gate.within --shard-files FILE`` (one path a line): every
shard of `vllm-overlay suite` is handed directories, not files, so pytest
collects them as it would without shards, conftest ``collect_ignore`` and
``collect_ignore_glob`` included (a file named on the command line bypasses
them); this plugin then ignores every file and directory that is not one of
the shard's files or above one. It never un-ignores: what a conftest leaves
out stays out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

OPTION = "--shard-files"


class Kept:
    def __init__(self, files: list[Path]):
        self.files = frozenset(files)
        self.dirs = frozenset(d for f in files for d in f.parents)


KEPT = pytest.StashKey[Kept]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION, default=None, type=Path, help="collect only these test files"
    )


def read_files(path: Path) -> list[Path]:
    lines = path.read_text().splitlines()
    return [Path(line).resolve() for line in lines if line.strip()]


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption(OPTION)
    if path is not None:
        config.stash[KEPT] = Kept(read_files(path))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    kept = config.stash.get(KEPT, None)
    if kept is None:
        return None
    path = collection_path.resolve()
    return None if path in kept.files or path in kept.dirs else True
