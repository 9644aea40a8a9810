"""Which tests may read vLLM's installed MoRIIO package: the evidence the
pytest plugin `vllm_overlay.gate.touch` writes, and the selection of the base
run `nox -s unit-base` makes from it."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.gate.reports import load_struct

_T = TypeVar("_T")


class Touches(msgspec.Struct, forbid_unknown_fields=True):
    """Per test id, why it may read the installed package (empty: it cannot);
    ``dirs``: the package's directory as watched; ``loaded``: the tests
    without a reason that ran with the package's modules in their process
    (a figure of what the evidence spares the base run)."""

    dirs: list[str]
    tests: dict[str, list[str]]
    loaded: list[str] = []


class Selection(msgspec.Struct, forbid_unknown_fields=True):
    """The test ids to run on the base: the touched ones, and a sample of the
    untouched ones whose outcomes must match the overlay's."""

    touched: list[str]
    sample: list[str]

    @property
    def ids(self) -> list[str]:
        return [*self.touched, *self.sample]


class EvidenceError(OverlayError):
    """A touches or selection file is missing, unreadable or inconsistent."""


def encode(value: Touches | Selection) -> bytes:
    return msgspec.json.encode(value)


def _load(path: Path, kind: type[_T], what: str) -> _T:
    return load_struct(path, kind, what, f"a {what} file", EvidenceError)


def load_touches(path: Path) -> Touches:
    return _load(path, Touches, "touches")


def load_selection(path: Path) -> Selection:
    return _load(path, Selection, "selection")


def merge(parts: list[Touches]) -> Touches:
    dirs: dict[str, None] = {}
    tests: dict[str, list[str]] = {}
    loaded: dict[str, None] = {}
    for part in parts:
        dirs.update(dict.fromkeys(part.dirs))
        loaded.update(dict.fromkeys(part.loaded))
        for test, why in part.tests.items():
            tests.setdefault(test, []).extend(why)
    return Touches(list(dirs), tests, [t for t in loaded if not tests.get(t)])


def _fnv(text: str) -> int:
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def select(touches: Touches, sample_size: int, seed: str) -> Selection:
    """Every touched test, and ``sample_size`` untouched ones picked by
    ``seed`` (the series id: another series, another sample), preferring one
    per test file: half of them (or all there are) from those that had the
    package loaded without reading or running it (`Touches.loaded`, the
    ones a value read without a call could make differ), the rest from the
    others."""
    touched = sorted(t for t, why in touches.tests.items() if why)
    untouched = sorted(t for t, why in touches.tests.items() if not why)
    ranked = sorted(untouched, key=lambda t: _fnv(f"{seed}\0{t}"))
    loaded = set(touches.loaded)
    near = [t for t in ranked if t in loaded]
    far = [t for t in ranked if t not in loaded]
    first = _spread(near, (sample_size + 1) // 2)
    sample = first + _spread(far, sample_size - len(first))
    sample += _spread([t for t in near if t not in sample], sample_size - len(sample))
    return Selection(touched, sorted(sample))


def _spread(ranked: list[str], size: int) -> list[str]:
    """Up to ``size`` of ``ranked``: the first one per file, then the rest
    in rank order."""
    sample: list[str] = []
    files: set[str] = set()
    for t in ranked:
        if len(sample) < size and t.split("::", 1)[0] not in files:
            sample.append(t)
            files.add(t.split("::", 1)[0])
    for t in ranked:
        if len(sample) < size and t not in sample:
            sample.append(t)
    return sample
