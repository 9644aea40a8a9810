"""The overlay checkout: where the pin, the series and the reports live.

Every command receives one ``Checkout`` (through the CLI's ``App``) instead
of looking for the repository itself; the pin and the series load on first
use, so `series check` can report a broken series instead of failing on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.series.patch_series import (
    PATCH_DIR,
    SERIES_FILE,
    Series,
    load_series,
)
from vllm_overlay.series.pin import PIN_FILE, Pin, load_pin

# Where the nox sessions and the CLI write their reports, in the checkout.
REPORT_DIR = ".nox-reports"
# The revert-red report `vllm-overlay gate` writes and export reads.
UNIT_BASE_REPORT = "unit-base.json"


class CheckoutError(OverlayError):
    """No overlay checkout where one was looked for."""


@dataclass(frozen=True)
class Checkout:
    root: Path  # absolute

    @classmethod
    def find(cls, repo: Path | None = None, start: Path | None = None) -> Checkout:
        """``repo`` when given; else the nearest directory above ``start``
        (the working directory) holding the pin and the series; else the
        checkout this package is installed from (editable install)."""
        if repo is not None:
            root = repo.resolve()
            if not root.is_dir():
                raise CheckoutError(f"--repo {repo}: no such directory")
            return cls(root)
        here = (start or Path.cwd()).resolve()
        for d in (here, *here.parents):
            if _holds_checkout(d):
                return cls(d)
        pkg_root = Path(__file__).resolve().parents[1]
        if _holds_checkout(pkg_root):
            return cls(pkg_root)
        raise CheckoutError(
            f"no overlay checkout found above {here} (looked for {PIN_FILE} and "
            f"{PATCH_DIR}/{SERIES_FILE}); pass --repo"
        )

    @property
    def unit_base_report(self) -> Path:
        """The revert-red report `nox -s unit-base` writes, export reads."""
        return self.root / REPORT_DIR / UNIT_BASE_REPORT

    def path(self, value: Path) -> Path:
        """``value`` taken relative to the checkout unless absolute."""
        return value if value.is_absolute() else self.root / value

    @cached_property
    def pin(self) -> Pin:
        return load_pin(self.root / PIN_FILE)

    @cached_property
    def series(self) -> Series:
        return load_series(self.root)


def _holds_checkout(d: Path) -> bool:
    return (d / PIN_FILE).is_file() and (d / PATCH_DIR / SERIES_FILE).is_file()
