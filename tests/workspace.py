"""Helpers for overlay-machinery tests: throwaway checkouts and vLLM trees."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.series.pin import MODULE_DIR

CONNECTOR = f"{MODULE_DIR}/moriio_connector.py"
# A line that stands once in the base moriio_connector.py: test patches edit
# around it.
ANCHOR = "def _split_kv_cache_group_kinds(\n"
COMMON = f"{MODULE_DIR}/moriio_common.py"


def make_diff(path: str, old: str, new: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=f"a/{path}",
        tofile=f"b/{path}",
    )
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


def header(subject: str, **overrides: str | None) -> str:
    fields: dict[str, str | None] = {
        "Description": f"[Bugfix] {subject}\n {subject}.\n A second line.",
        "Origin": "vendor",
        "Author": "tests",
        "Forwarded": "no",
        "Last-Update": "2026-11-30",
        "Remove-When": "never",
        "Tests": "tests/conftest.py",
    }
    fields.update(overrides)
    return "".join(
        f"{key}: {value}\n".replace(": \n", ":\n")
        for key, value in fields.items()
        if value is not None
    )


def patch_header(name: str) -> str:
    """The header of patch ``name``, its Tests a test of its own (a test proves
    one patch)."""
    return header(name, Tests=f"tests/conftest.py::test_{name[:4]}")


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"anchor {old!r} not unique in the base"
    return text.replace(old, new)


@dataclass
class Workspace:
    """A throwaway overlay checkout (pin + patches/) and vLLM tree."""

    repo: Path
    site: Path  # plays site-packages: holds vllm/
    base: dict[str, str]

    @property
    def vllm(self) -> Path:
        return self.site / "vllm"

    def add_patch(self, name: str, text: str, *, listed: bool = True) -> None:
        (self.repo / "patches" / name).write_text(text)
        if listed:
            with (self.repo / "patches" / "series").open("a") as f:
                f.write(name + "\n")

    def patch_from_edit(
        self,
        name: str,
        path: str,
        edit: Callable[[str], str],
        *,
        on: str | None = None,
        own_tests: bool = False,
    ) -> str:
        """A patch turning ``on`` (default: the base text) into ``edit(on)``;
        ``own_tests``: its Tests name a test no other patch names."""
        old = self.base[path] if on is None else on
        new = edit(old)
        head = patch_header(name) if own_tests else header(name)
        self.add_patch(name, head + "---\n" + make_diff(path, old, new))
        return new

    def snapshot(self) -> dict[str, bytes]:
        return {
            p.relative_to(self.site).as_posix(): p.read_bytes()
            for p in sorted(self.site.rglob("*"))
            if p.is_file()
        }


def fake_site(site: Path, texts: dict[str, str]) -> Path:
    """A fake site-packages at ``site`` whose vllm holds only ``texts``
    (path -> text, the pinned files); returns ``site``."""
    (site / "vllm" / "distributed").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    for path, text in texts.items():
        dest = site / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    return site
