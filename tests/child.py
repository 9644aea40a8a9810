"""Run Python code in a child interpreter, as tests that need a fresh process
(vLLM's plugin loading, a rank's process state) do."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping


def run_python(
    code: str, *args: str, env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    """``python -c code args...`` under ``env``, its output captured as text;
    five minutes at most."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=300,
    )
