"""The CPU vLLM environment the nox sessions share (`.nox/cpu-vllm`; `.venv`
is a link to it).

vLLM is installed there with ``--no-deps`` next to a CPU build of torch and
vLLM's pure-Python requirements, so some of its requirements are unmet on
purpose; ``pip check`` tells those from real conflicts. This package is
installed in editable mode once, and again only when the checkout or its
``pyproject.toml`` changes. A ``.pth`` file sets ``VLLM_OVERLAY_CPU_PLATFORM=1``
unless it is set, so every process there (``vllm --version`` too) runs on the
overlay's test-only CPU platform (``cpuplatform``); ``=0`` turns it off.

Standard library only: the noxfile imports it before any environment exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import cpuplatform

DEVICE_PTH = "vllm-overlay-cpu.pth"
# Lines of a .pth file that start with "import" run at interpreter start.
DEVICE_PTH_TEXT = f'import os; os.environ.setdefault("{cpuplatform.ENV}", "1")\n'
EDITABLE_STAMP = ".editable-stamp"

_NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_REQUIRES_RE = re.compile(
    r"^(?P<who>\S+) (?P<version>\S+) requires (?P<req>.+), which is not installed\.$"
)
_HAS_RE = re.compile(
    r"^(?P<who>\S+) (?P<version>\S+) has requirement (?P<req>.+), "
    r"but you have (?P<have>.+)\.$"
)


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """The normalized project name a requirement line or spec starts with
    ("" for comments, options and blank lines)."""
    spec = spec.split("#", 1)[0].strip()
    if not spec or spec.startswith("-"):
        return ""
    m = _NAME_RE.match(spec)
    return normalize(m.group(0)) if m else ""


def requirement_names(lines: Iterable[str]) -> set[str]:
    return {n for n in map(requirement_name, lines) if n}


@dataclass(frozen=True)
class Unmet:
    """One line of ``pip check``: ``who`` (a ``name version``) lacks ``req``."""

    who: str
    req: str
    have: str  # "" when not installed at all
    line: str


@dataclass(frozen=True)
class PipCheck:
    expected: list[Unmet]
    unexpected: list[str]  # pip check lines, as printed

    def summary(self) -> str:
        """One line for the log."""
        if not self.expected and not self.unexpected:
            return "pip check: every requirement is met"
        by_who: dict[str, int] = {}
        for u in self.expected:
            by_who[u.who] = by_who.get(u.who, 0) + 1
        counts = ", ".join(f"{who}: {n}" for who, n in by_who.items())
        swapped = "".join(
            f" with {u.have} for {u.req}" for u in self.expected if u.have
        )
        line = (
            f"pip check: {len(self.expected)} unmet requirements, all left out on "
            f"purpose ({counts}; installed --no-deps{swapped} and without the "
            "GPU/CUDA/media packages)"
        )
        if self.unexpected:
            line += f"; {len(self.unexpected)} unexpected: " + "; ".join(
                self.unexpected
            )
        return line


def classify_pip_check(
    output: str, no_deps: Iterable[str], installed: Iterable[str]
) -> PipCheck:
    """Sort ``pip check`` output: an unmet requirement of a package installed
    ``--no-deps`` (``no_deps``, names) is expected when the environment does
    not install that requirement at all (``installed``: the names of every
    requirement file's lines). Anything else (a listed requirement at the
    wrong version, a conflict of another package, a line not understood) is
    unexpected."""
    skipped = {normalize(n) for n in no_deps}
    listed = {normalize(n) for n in installed}
    expected: list[Unmet] = []
    unexpected: list[str] = []
    for line in output.splitlines():
        line = line.strip()
        if not line or line.startswith("No broken requirements"):
            continue
        m = _REQUIRES_RE.match(line) or _HAS_RE.match(line)
        if m is None:
            unexpected.append(line)
            continue
        who = f"{m.group('who')} {m.group('version')}"
        have = m.groupdict().get("have") or ""
        unmet = Unmet(who, m.group("req").strip(), have, line)
        name = requirement_name(unmet.req)
        if normalize(m.group("who")) in skipped and name not in listed:
            expected.append(unmet)
        else:
            unexpected.append(line)
    return PipCheck(expected, unexpected)


def pip_find_links(config: str) -> list[str]:
    """The ``find-links`` locations in ``pip config list`` output (every
    scope: ``global.find-links='/opt/wheels'``, ``:env:.find-links=...``),
    in order, each once. uv reads no pip configuration: the CPU environment's
    build hands these over, so both installers see the same local wheels."""
    links: dict[str, None] = {}
    for line in config.splitlines():
        key, sep, value = line.partition("=")
        if not sep or key.strip().rpartition(".")[2] != "find-links":
            continue
        links.update(dict.fromkeys(value.strip().strip("'\"").split()))
    return list(links)


def site_packages(env: Path) -> Path:
    """The one ``lib/pythonX.Y/site-packages`` of a POSIX virtualenv."""
    found = sorted(env.glob("lib/python3.*/site-packages"))
    if len(found) != 1:
        raise FileNotFoundError(f"{env}: expected one site-packages, found {found}")
    return found[0]


def editable_key(root: Path, extras: str = "") -> str:
    """What the editable install depends on: the checkout's path, the extras
    installed with it and its ``pyproject.toml`` (entry points,
    dependencies)."""
    text = (root / "pyproject.toml").read_bytes()
    return f"{root.resolve()}{extras}\n{hashlib.sha256(text).hexdigest()}\n"


def editable_is_current(env: Path, root: Path, dist: str, extras: str = "") -> bool:
    """Whether ``env`` has ``dist`` installed in editable mode from ``root``
    (with ``extras``) and the current ``pyproject.toml`` (stamped by
    ``stamp_editable``)."""
    try:
        sp = site_packages(env)
    except FileNotFoundError:
        return False
    stamp = env / EDITABLE_STAMP
    if not stamp.is_file() or stamp.read_text() != editable_key(root, extras):
        return False
    prefix = normalize(dist).replace("-", "_") + "-"
    for info in sp.glob("*.dist-info"):
        if not info.name.lower().startswith(prefix):
            continue
        try:
            direct = json.loads((info / "direct_url.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(
            direct.get("dir_info", {}).get("editable")
            and direct.get("url") == root.resolve().as_uri()
        )
    return False


def stamp_editable(env: Path, root: Path, extras: str = "") -> None:
    (env / EDITABLE_STAMP).write_text(editable_key(root, extras))


def ensure_device_pth(env: Path) -> bool:
    """Write the CPU-platform ``.pth``; True when it changed."""
    path = site_packages(env) / DEVICE_PTH
    if path.is_file() and path.read_text() == DEVICE_PTH_TEXT:
        return False
    path.write_text(DEVICE_PTH_TEXT)
    return True


def link_dev_env(dev: Path, env: Path, stamp: str) -> str:
    """Make ``dev`` (``.venv``) a relative link to ``env``; returns what was
    done ("" when nothing). A separate environment an older noxfile built
    there (it holds ``stamp``) is removed; anything else raises
    ``FileExistsError`` and is left alone."""
    target = Path(os.path.relpath(env, dev.parent))
    if dev.is_symlink():
        if Path(os.readlink(dev)) == target:
            return ""
        dev.unlink()
        done = f"{dev.name} -> {target} (was a link elsewhere)"
    elif dev.exists():
        if not (dev / stamp).is_file():
            raise FileExistsError(
                f"{dev} exists and is not an environment `nox -s dev` made; "
                "move it away"
            )
        shutil.rmtree(dev)
        done = f"{dev.name} -> {target} (the separate copy an older noxfile built "
        done += "is removed)"
    else:
        done = f"{dev.name} -> {target}"
    dev.symlink_to(target, target_is_directory=True)
    return done
