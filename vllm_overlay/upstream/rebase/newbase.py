"""The base to rebase onto: a wheel, a vLLM tree, or a version fetched by pip."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.series.pin import sha256_file
from vllm_overlay.tree.target import detect_target
from vllm_overlay.upstream.rebase.report import RebaseError

DEFAULT_CACHE = Path.home() / ".cache" / "vllm-overlay" / "wheels"
_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+\S*$")


@dataclass(frozen=True)
class NewBase:
    """The module files of the base to rebase onto, and where they came from."""

    source: str
    version: str
    git_commit: str  # "" when the source does not record it
    wheel: str  # "" for a source tree
    wheel_sha256: str
    files: dict[str, bytes]

    def text(self, path: str) -> str | None:
        data = self.files.get(path)
        return None if data is None else data.decode()


def _version_info(text: str) -> tuple[str, str]:
    """(version, git commit) from a vLLM ``_version.py``; "" when absent."""
    version = re.search(r"^__version__ = version = '([^']+)'", text, re.M)
    commit = re.search(r"^__commit_id__ = commit_id = '(?:g)?([0-9a-f]+)'", text, re.M)
    return (version.group(1) if version else "", commit.group(1) if commit else "")


def new_base_from_wheel(wheel: Path, module: str) -> NewBase:
    prefix = module.rstrip("/") + "/"
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise RebaseError(f"{wheel}: not a readable wheel: {e}") from None
    with zf:
        names = [
            n
            for n in zf.namelist()
            if n.startswith(prefix) and not n.endswith("/") and "__pycache__" not in n
        ]
        if not names:
            raise RebaseError(f"{wheel}: holds no {module}")
        files = {n: zf.read(n) for n in sorted(names)}
        try:
            version_py = zf.read("vllm/_version.py").decode()
        except KeyError:
            version_py = ""
    version, commit = _version_info(version_py)
    if not version:
        version = wheel.name.split("-")[1]
    return NewBase(
        source=f"wheel {wheel}",
        version=version,
        git_commit=commit,
        wheel=wheel.name,
        wheel_sha256=sha256_file(wheel),
        files=files,
    )


def new_base_from_source(path: Path, module: str) -> NewBase:
    target = detect_target(path)
    base = target.root / module
    if not base.is_dir():
        raise RebaseError(f"{target.describe()}: has no {module}")
    files = {
        p.relative_to(target.root).as_posix(): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
    }
    version_py = target.root / "vllm" / "_version.py"
    version, commit = _version_info(
        version_py.read_text() if version_py.is_file() else ""
    )
    if (target.root / ".git").exists():
        head = subprocess.run(
            ["git", "-C", str(target.root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
        )
        if head.returncode == 0:
            commit = head.stdout.strip()
    return NewBase(
        source=target.describe(),
        version=version,
        git_commit=commit,
        wheel="",
        wheel_sha256="",
        files=files,
    )


def fetch_version(version: str, cache: Path) -> Path:
    """The wheel of vLLM ``version`` in ``cache``, downloaded by pip when
    missing (pip's own cache avoids a second download)."""
    dest = cache / f"vllm-{version}"
    found = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if not found:
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            f"vllm=={version}",
            "-d",
            str(dest),
        ]
        print(f"rebase: {' '.join(cmd)}", flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            tail = (run.stderr or run.stdout).strip().splitlines()[-1:]
            why = " ".join(tail) or f"exit {run.returncode}"
            raise RebaseError(f"pip download vllm=={version} failed: {why}")
        found = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if len(found) != 1:
        raise RebaseError(f"{dest}: expected one vllm-{version} wheel, found {found}")
    return found[0]


def resolve_new_base(spec: str, module: str, cache: Path) -> NewBase:
    path = Path(spec)
    if path.suffix == ".whl":
        if not path.is_file():
            raise RebaseError(f"{spec}: no such wheel")
        return new_base_from_wheel(path, module)
    if path.is_dir():
        return new_base_from_source(path, module)
    if _VERSION_RE.match(spec):
        return new_base_from_wheel(fetch_version(spec, cache), module)
    raise RebaseError(f"--to {spec!r}: neither a wheel, a directory nor a version")
