"""The base-file options of the commands that read the pinned base files:
``--wheel WHEEL | --from DIR`` (default ``$VLLM_OVERLAY_WHEEL``, else this
Python's vllm), and the ``BaseSource`` they name."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_overlay.tree.materialize import WHEEL_ENV, BaseSource


def add_base_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--wheel WHEEL | --from DIR``: where ``what`` (the pinned base files)
    comes from; read back with ``base_source(args)``."""
    g = parser.add_argument_group(
        f"{what} (default: ${WHEEL_ENV}, else this Python's vllm)"
    )
    one = g.add_mutually_exclusive_group()
    one.add_argument(
        "--wheel", type=Path, metavar="WHEEL", help="the pinned vLLM wheel"
    )
    one.add_argument(
        "--from",
        dest="base_tree",
        type=Path,
        metavar="DIR",
        help="a vLLM tree (installed package or source root) holding the base "
        "or a known overlay",
    )


def base_source(args: argparse.Namespace) -> BaseSource:
    return BaseSource(wheel=args.wheel, tree=args.base_tree)
