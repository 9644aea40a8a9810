"""The pinned base's mypy errors, kept in a file per key.

`nox -s lint` checks the overlaid vLLM files with mypy and vLLM's settings
and fails on an error the pinned base does not have (vllm_overlay/mypybase.py).
The base's errors depend only on the wheel, mypy's version and the settings
(`mypybase.base_key`), so they are read from ``ci/mypy-base-errors/KEY.json``
(committed) or ``.nox-cache/mypy-base-errors/KEY.json`` (this machine's),
and mypy runs on the base only when neither has the key. The noxfile runs
this module in the lint environment (it has msgspec, the noxfile does not):

    python -m vllm_overlay.mypybasecache get --key KEY --dir D [--dir D2] --out REPORT
    python -m vllm_overlay.mypybasecache put --dir D --report REPORT \
        --wheel-sha256 S --mypy-version V --settings-sha256 H FILE...

``get`` writes the cached errors as a mypy report to REPORT, or removes
REPORT and says why there is none (missing, unreadable, another key's);
``put`` records a report mypy printed for the base.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from vllm_overlay.mypybase import MypyError, base_key, format_errors, parse_errors


class CachedError(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    code: str
    message: str


class BaseErrors(msgspec.Struct, forbid_unknown_fields=True):
    """mypy's errors on the pinned base's files with vLLM's settings."""

    wheel_sha256: str
    mypy_version: str
    settings_sha256: str
    files: list[str]
    errors: list[CachedError]

    @property
    def key(self) -> str:
        return base_key(self.wheel_sha256, self.mypy_version, self.settings_sha256)

    def mypy_errors(self) -> list[MypyError]:
        return [MypyError(e.path, e.code, e.message) for e in self.errors]


def _shown(path: Path) -> str:
    cwd = Path.cwd()
    return str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)


def lookup(dirs: Sequence[Path], key: str) -> tuple[BaseErrors | None, str]:
    """The entry for ``key`` in the first of ``dirs`` that has a valid one,
    and a line saying where it came from or why there is none."""
    problems = []
    for directory in dirs:
        path = directory / f"{key}.json"
        try:
            entry = msgspec.json.decode(path.read_bytes(), type=BaseErrors)
        except FileNotFoundError:
            continue
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            problems.append(f"{_shown(path)} is unreadable ({e})")
            continue
        if entry.key != key:
            problems.append(f"{_shown(path)} is stale (it holds key {entry.key})")
            continue
        return entry, (
            f"mypy: the pinned base's {len(entry.errors)} error(s) from "
            f"{_shown(path)} (mypy not run on the base)"
        )
    others = sorted(
        p.stem for d in dirs if d.is_dir() for p in d.glob("*.json") if p.stem != key
    )
    why = "; ".join(problems) or "no entry"
    if others:
        why += f"; entries for other keys: {', '.join(others)}"
    return None, f"mypy: no cached base errors for {key} ({why}): mypy runs on the base"


def store(directory: Path, entry: BaseErrors) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{entry.key}.json"
    data = msgspec.json.format(msgspec.json.encode(entry), indent=2)
    path.write_bytes(data + b"\n")
    return path


def _cmd_get(args: argparse.Namespace) -> int:
    entry, line = lookup(args.dir, args.key)
    print(line)
    if entry is None:
        args.out.unlink(missing_ok=True)
    else:
        args.out.write_text(format_errors(entry.mypy_errors()))
    return 0


def _cmd_put(args: argparse.Namespace) -> int:
    try:
        report = args.report.read_text()
    except OSError as e:
        print(f"mypybasecache: {args.report}: {e.strerror}", file=sys.stderr)
        return 2
    errors = [CachedError(e.path, e.code, e.message) for e in parse_errors(report)]
    entry = BaseErrors(
        wheel_sha256=args.wheel_sha256,
        mypy_version=args.mypy_version,
        settings_sha256=args.settings_sha256,
        files=sorted(args.files),
        errors=errors,
    )
    path = store(args.dir, entry)
    print(f"mypy: the pinned base's {len(errors)} error(s) recorded in {_shown(path)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_overlay.mypybasecache",
        description=(__doc__ or "").splitlines()[0],
    )
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("get", help="the cached base errors for KEY, as a report")
    get.add_argument("--key", required=True)
    get.add_argument("--dir", type=Path, action="append", required=True)
    get.add_argument("--out", type=Path, required=True)
    get.set_defaults(handler=_cmd_get)
    put = sub.add_parser("put", help="record mypy's report on the base")
    put.add_argument("--dir", type=Path, required=True)
    put.add_argument("--report", type=Path, required=True)
    put.add_argument("--wheel-sha256", required=True)
    put.add_argument("--mypy-version", required=True)
    put.add_argument("--settings-sha256", required=True)
    put.add_argument("files", nargs="+")
    put.set_defaults(handler=_cmd_put)
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
