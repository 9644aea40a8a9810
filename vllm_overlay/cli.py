"""`vllm-overlay`: the command line of the overlay.

Every area registers its own subcommands (``<area>/cli.py``); this module
lists them, owns the global options and turns every failure into one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from vllm_overlay import __version__
from vllm_overlay.command import (
    EXIT_ERROR,
    App,
    Parser,
    Subparsers,
    UsageError,
    add_subcommands,
    global_options,
    parse_command_line,
)
from vllm_overlay.e2e import cli as e2e_cli
from vllm_overlay.errors import OverlayError
from vllm_overlay.gate import cli as gate_cli
from vllm_overlay.image import cli as image_cli
from vllm_overlay.series import cli as series_cli
from vllm_overlay.simulate import cli as simulate_cli
from vllm_overlay.tree import cli as tree_cli
from vllm_overlay.upstream import cli as upstream_cli

# In the order `--help` lists them: the series, the tree, the proof, the
# simulator, the image and E2E run, upstream.
AREAS: tuple[Callable[[Subparsers], None], ...] = (
    series_cli.register,
    tree_cli.register,
    gate_cli.register,
    simulate_cli.register,
    image_cli.register,
    e2e_cli.register,
    upstream_cli.register,
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="vllm-overlay",
        description=(
            "Apply, check and maintain the MoRIIO patch series on a pinned vLLM."
        ),
        parents=[global_options(root=True)],
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}"
    )
    sub = add_subcommands(parser, "command")
    for register in AREAS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr and status 2
    (with ``--json``, also a JSON object on stdout)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    app = App(json="--json" in args_list)
    try:
        args = parse_command_line(build_parser(), args_list)
        app = App(repo=args.repo, json=args.json)
        code = int(args.handler(app, args))
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except (OverlayError, UsageError) as e:
        return app.fail(str(e))
    except KeyboardInterrupt:
        return app.fail("interrupted")
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more can be said there.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return app.fail(f"{where}{e.strerror or e}")
    except Exception as e:  # a bug: still one line, unless asked for more
        if os.environ.get("VLLM_OVERLAY_DEBUG"):
            raise
        return app.fail(
            f"internal error: {type(e).__name__}: {e} "
            "(VLLM_OVERLAY_DEBUG=1 shows the traceback)"
        )


if __name__ == "__main__":
    sys.exit(main())
