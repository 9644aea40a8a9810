"""The checkout under test, for what a test module needs at import time
(parametrize lists, module constants); tests take the ``repo``, ``pin``
and ``series`` fixtures of tests/conftest.py otherwise."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
