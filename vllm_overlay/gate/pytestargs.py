"""Which of `nox -s unit`'s arguments are paths to collect, which go to pytest.

Standard library only: the noxfile imports it. `nox -s unit -- tests/AREA -k
EXPR` spreads the paths over the cores (`vllm-overlay suite`); the rest are
pytest's options and their values.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# pytest options whose value is the next argument (never a path to collect).
VALUE_OPTIONS = frozenset(
    {"-k", "-m", "-p", "-o", "-c", "-W", "--deselect", "--ignore", "--ignore-glob"}
    | {"--maxfail", "--tb", "--durations", "--durations-min", "--basetemp"}
    | {"--hypothesis-profile", "--hypothesis-seed", "--rootdir"}
)


def split_paths(root: Path, args: Sequence[str]) -> tuple[list[str], list[str]]:
    """The existing paths under ``root`` among pytest's arguments (not an
    option, not an option's value), and the rest in their order."""
    paths: list[str] = []
    rest: list[str] = []
    for i, arg in enumerate(args):
        value = i > 0 and args[i - 1] in VALUE_OPTIONS
        if not value and not arg.startswith("-") and (root / arg).exists():
            paths.append(arg)
        else:
            rest.append(arg)
    return paths, rest


def names_a_test(args: Sequence[str]) -> bool:
    """Whether an argument is a test id (``FILE::TEST``): pytest runs it
    in one process, as given."""
    return any("::" in a and not a.startswith("-") for a in args)


def rooted(root: Path) -> list[str]:
    """pytest's ``--rootdir`` and, when ``root`` has one, its configuration
    file: pytest looks for that file above the arguments' common directory,
    which a run's output or tree outside the checkout (``$TMPDIR``) moves
    to ``/``, and the run would go without the checkout's settings."""
    config = root / "pyproject.toml"
    return ["--rootdir", str(root), *(["-c", str(config)] if config.is_file() else [])]
