"""What every subcommand shares: the ``App`` it receives, the global options,
and how a subcommand is declared.

Each area (``series``, ``tree``, ``gate``, ``upstream``, ``image``,
``simulate``, ``e2e``) has a ``cli.py`` with ``register(sub)``; the root
``vllm_overlay.cli`` calls every one of them explicitly.

Output rules, the same in every command:

- text for people on stdout, ending with a one-line summary;
- with ``--json``, stdout holds exactly one JSON object (the command's
  result, or ``{"error": ...}``) and the text is left out (progress of long
  work still shows on stderr);
- an error is one line ``error: ...`` on stderr and exit status 2;
- output never fails on a character the stream cannot encode (a file name
  that is not UTF-8, an ASCII-only terminal): text gets backslash escapes,
  JSON ``\\uXXXX`` escapes, so a command that did its work never ends in an
  encoding error.
"""

from __future__ import annotations

import argparse
import inspect
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TextIO, TypeAlias

import msgspec

from vllm_overlay.checkout import Checkout

# argparse's generic is typed only for type checkers (annotations here).
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Handler = Callable[["App", argparse.Namespace], int]

EXIT_ERROR = 2
# Seconds between two progress lines when stderr is not a terminal.
PROGRESS_EVERY = 30.0


@dataclass
class App:
    """The command line's context: the options every command has, the
    checkout, and the two output streams."""

    repo: Path | None = None
    json: bool = False
    stdout: TextIO | None = None
    stderr: TextIO | None = None
    clock: Callable[[], float] = time.monotonic
    _last_progress: float | None = None

    @cached_property
    def checkout(self) -> Checkout:
        return Checkout.find(self.repo)

    @property
    def out(self) -> TextIO:
        return self.stdout or sys.stdout

    @property
    def err(self) -> TextIO:
        return self.stderr or sys.stderr

    def say(self, text: str = "") -> None:
        """A line for people on stdout (left out under ``--json``)."""
        if not self.json:
            write_text(self.out, text + "\n")

    def progress(self, line: str) -> None:
        """Progress of long work on stderr: on a terminal, one line that
        overwrites itself; otherwise (a log, CI) a plain line at most every
        ``PROGRESS_EVERY`` seconds, as pip and pytest do."""
        if self.err.isatty():
            self.err.write("\r\x1b[K" + line[: shutil.get_terminal_size().columns - 1])
        else:
            now = self.clock()
            if self._last_progress is not None and (
                now - self._last_progress < PROGRESS_EVERY
            ):
                return
            self._last_progress = now
            self.err.write(line + "\n")
        self.err.flush()

    def note(self, line: str) -> None:
        """A line on stderr that stays (what long work is about to do),
        also under ``--json``; on a terminal it replaces a progress line."""
        self.err.write(("\r\x1b[K" if self.err.isatty() else "") + line + "\n")
        self.err.flush()

    def end_progress(self) -> None:
        if self.err.isatty():
            self.err.write("\r\x1b[K")
            self.err.flush()
        self._last_progress = None

    def result(self, value: Any) -> None:
        """The command's result: one JSON object on stdout under ``--json``."""
        if self.json:
            try:
                data = msgspec.json.encode(value)
            except UnicodeEncodeError:  # a lone surrogate: an undecodable name
                data = msgspec.json.encode(
                    _escape_surrogates(msgspec.to_builtins(value))
                )
            text = msgspec.json.format(data, indent=2).decode() + "\n"
            if not _encodable(self.out, text):
                text = _NON_ASCII.sub(_json_escape, text)
            self.out.write(text)
            self.out.flush()

    def fail(self, message: str) -> int:
        """Report an error: one line on stderr (and a JSON object under
        ``--json``); returns the exit status."""
        line = " ".join(message.split("\n"))
        write_text(self.err, f"error: {line}\n")
        self.err.flush()
        if self.json:
            self.result({"error": line})
        return EXIT_ERROR


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def _encodable(stream: TextIO, text: str) -> bool:
    try:
        text.encode(getattr(stream, "encoding", None) or "utf-8")
    except UnicodeEncodeError:
        return False
    except LookupError:
        return True
    return True


def write_text(stream: TextIO, text: str) -> None:
    """``text`` on ``stream``; what its encoding cannot take (a lone
    surrogate from a file name that is not UTF-8, anything non-ASCII on an
    ASCII stream) is written as a backslash escape."""
    if not _encodable(stream, text):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        text = _unsurrogate(text).encode(encoding, "backslashreplace").decode(encoding)
    stream.write(text)


def _unsurrogate(text: str) -> str:
    """``text`` with the lone surrogates a file name that is not UTF-8
    decodes to shown as the bytes they stand for (``\\xff``)."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no name decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def _json_escape(match: re.Match[str]) -> str:
    """A non-ASCII character as JSON ``\\uXXXX`` escapes (a surrogate pair
    beyond the BMP); valid only inside a JSON string, where JSON puts it."""
    raw = match.group().encode("utf-16-be", "surrogatepass")
    units = (int.from_bytes(raw[i : i + 2], "big") for i in range(0, len(raw), 2))
    return "".join(f"\\u{unit:04x}" for unit in units)


def _escape_surrogates(value: Any) -> Any:
    """``value`` (builtins) with each string's lone surrogates (from a file
    name that is not UTF-8) turned into backslash escapes."""
    if isinstance(value, str):
        return _unsurrogate(value)
    if isinstance(value, dict):
        return {_escape_surrogates(k): _escape_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_surrogates(v) for v in value]
    return value


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line and exit status 2."""

    def error(self, message: str) -> Any:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


class UsageError(Exception):
    """The command line itself is wrong."""


def parse_command_line(
    parser: argparse.ArgumentParser, argv: list[str]
) -> argparse.Namespace:
    """``parser.parse_args``, but an unknown argument points at the help of
    the subcommand it was given to, as a missing one does."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        prog = getattr(args, "command_prog", parser.prog)
        raise UsageError(
            f"unrecognized arguments: {' '.join(unknown)} (see `{prog} --help`)"
        )
    return args


def global_options(*, root: bool) -> argparse.ArgumentParser:
    """``--repo`` and ``--json``, accepted before and after the subcommand.

    On the subcommands their default is "not given", so a value given
    before the subcommand survives."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("global options")
    unset: Any = None if root else argparse.SUPPRESS
    g.add_argument(
        "--repo",
        type=Path,
        metavar="DIR",
        default=unset,
        help="the overlay checkout (default: found above the working directory)",
    )
    g.add_argument(
        "--json",
        action="store_true",
        default=False if root else argparse.SUPPRESS,
        help="print the result as one JSON object on stdout instead of text",
    )
    return p


_LEAF_PARENTS = [global_options(root=False)]


def add_command(
    sub: Subparsers, name: str, handler: Handler | None, *, doc: str = ""
) -> argparse.ArgumentParser:
    """Declare a subcommand: its ``--help`` is the handler's docstring (or
    ``doc``; its first line is the one-line help). ``handler`` None: a group
    of subcommands."""
    text = inspect.cleandoc(doc or (handler.__doc__ if handler else "") or "")
    if not text:
        raise TypeError(f"subcommand {name!r} needs a docstring")
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=text.split("\n\n", 1)[0].rstrip(".").replace("\n", " "),
        description=text,
        parents=_LEAF_PARENTS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(command_prog=parser.prog)
    if handler is not None:
        parser.set_defaults(handler=handler)
    return parser


def add_subcommands(parser: argparse.ArgumentParser, dest: str) -> Subparsers:
    return parser.add_subparsers(
        dest=dest, required=True, metavar="COMMAND", parser_class=Parser
    )


def add_target_option(parser: argparse.ArgumentParser) -> None:
    """``--target PATH``: the vLLM tree a command reads or changes."""
    parser.add_argument(
        "--target",
        type=Path,
        metavar="PATH",
        help="an installed vllm package directory or a vLLM source root "
        "(default: this Python's vllm)",
    )
