"""Write the bytecode of what the suite's processes import.

``python -m vllm_overlay.gate.bytecode ROOT STAMP KEY``: uv installs no
bytecode, and the suite runs with PYTHONDONTWRITEBYTECODE, so every process
compiles the sources it imports that have none. Compiling the whole CPU
environment costs a minute of CPU, most of it on packages no test imports
(openai, anthropic, pip, ...). This imports, with bytecode writing on, what
the suite's servers load once for all runs (the modules the test files import
at collection, vLLM's and third-party, never vLLM's MoRIIO package, which
`vllm-overlay apply` rewrites) and vLLM's command line: exactly those files
get their bytecode. A module only a few processes import is compiled by them.

STAMP records KEY (the environment's build) and the modules imported: a
later call with the same ones does nothing. Prints one line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_overlay.gate.shards import preload_names, test_files

# What `vllm --version`, `vllm serve` and the plugin loader import first.
COMMAND_LINE = ("vllm.entrypoints.cli.main",)


def module_names(root: Path) -> list[str]:
    """torch first (vLLM expects it), then what the servers preload."""
    names = preload_names(root, test_files(root, ["tests"]))
    return list(dict.fromkeys(["torch", "pytest", *names, *COMMAND_LINE]))


def stamp_text(key: str, names: Sequence[str]) -> str:
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()
    return f"{key}\n{digest}\n"


def compiled_since(started: float) -> int:
    """The loaded modules whose bytecode was written from ``started`` on."""
    count = 0
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if not source or not source.endswith(".py"):
            continue
        try:
            cached = importlib.util.cache_from_source(source)
            if os.stat(cached).st_mtime >= started:
                count += 1
        except (OSError, ValueError, NotImplementedError):
            continue
    return count


def write(names: Sequence[str]) -> tuple[int, int]:
    """Import ``names`` writing bytecode; (modules loaded, files compiled).
    A name that is not a module, or fails to import, is skipped."""
    sys.dont_write_bytecode = False
    started = time.time() - 1  # st_mtime is coarser than time.time()
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (only a head start)
            continue
    return len(sys.modules), compiled_since(started)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 3:
        usage = "usage: python -m vllm_overlay.gate.bytecode ROOT STAMP KEY"
        print(usage, file=sys.stderr)
        return 2
    root, stamp, key = Path(argv[0]), Path(argv[1]), argv[2]
    if not (root / "tests").is_dir():
        print(f"bytecode: {root}: no tests/ directory to read", file=sys.stderr)
        return 2
    if not stamp.parent.is_dir():
        print(f"bytecode: {stamp.parent}: not a directory", file=sys.stderr)
        return 2
    names = module_names(root)
    text = stamp_text(key, names)
    try:
        current = stamp.read_text() == text
    except OSError:
        current = False
    if current:
        print(f"bytecode: current for the {len(names)} names the suite imports")
        return 0
    t0 = time.monotonic()
    loaded, compiled = write(names)
    try:
        stamp.write_text(text)
    except OSError as e:
        print(f"bytecode: cannot write {stamp}: {e.strerror}", file=sys.stderr)
        return 1
    print(
        f"bytecode: {compiled} files compiled; {loaded} modules loaded from the "
        f"{len(names)} names the suite imports ({time.monotonic() - t0:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
