"""The base to rebase onto: a wheel, a vLLM tree, or a version fetched by pip."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.series.pin import sha256_file
from vllm_overlay.tree.manifest import load_manifest, manifest_path
from vllm_overlay.tree.target import detect_target
from vllm_overlay.upstream.rebase.report import RebaseError

DEFAULT_CACHE = Path.home() / ".cache" / "vllm-overlay" / "wheels"
_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+\S*$")
_RELEASE_RE = re.compile(r"^(\d+(?:\.\d+)*)")
FORMS = (
    "--to takes a vLLM version on the package index (pip download), a wheel "
    "file (a nightly: --to path/to/vllm-VERSION-*.whl) or a vLLM tree (--to DIR: "
    "a source checkout or a site-packages directory holding vllm/)"
)


@dataclass(frozen=True)
class NewBase:
    """The module files of the base to rebase onto, and where they came from."""

    source: str
    version: str
    git_commit: str  # "" when the source does not record it
    wheel: str  # "" for a source tree
    wheel_sha256: str
    files: dict[str, bytes]
    # A tree overlaid by `vllm-overlay apply`: what its manifest says it
    # carries ("" for none).
    overlay: str = ""
    # The core files the pin's ``core_files`` names that this base holds.
    core_files: dict[str, bytes] = field(default_factory=dict)

    def text(self, path: str) -> str | None:
        data = self.files.get(path)
        return None if data is None else data.decode()


def _version_info(text: str) -> tuple[str, str]:
    """(version, git commit) from a vLLM ``_version.py``; "" when absent."""
    version = re.search(r"^__version__ = version = '([^']+)'", text, re.M)
    commit = re.search(r"^__commit_id__ = commit_id = '(?:g)?([0-9a-f]+)'", text, re.M)
    return (version.group(1) if version else "", commit.group(1) if commit else "")


def new_base_from_wheel(
    wheel: Path, module: str, core_paths: Iterable[str] = ()
) -> NewBase:
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
        held = set(zf.namelist())
        core = {p: zf.read(p) for p in sorted(core_paths) if p in held}
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
        core_files=core,
    )


def new_base_from_source(
    path: Path, module: str, core_paths: Iterable[str] = ()
) -> NewBase:
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
        overlay=_overlay(target.root, module),
        core_files={
            p: (target.root / p).read_bytes()
            for p in sorted(core_paths)
            if (target.root / p).is_file()
        },
    )


def _overlay(root: Path, module: str) -> str:
    """What the tree's overlay manifest says it carries; "" without one."""
    path = manifest_path(root, module)
    if not path.exists():
        return ""
    manifest, problem = load_manifest(path)
    if manifest is None:
        return f"an overlay whose manifest {path} is unusable ({problem})"
    return (
        f"an overlay of series {manifest.series_id} ({len(manifest.patches)} "
        f"patches on vLLM {manifest.vllm_version})"
    )


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version (``0.34.0.dev12+g1`` -> (0, 34, 0));
    () when it has none."""
    m = _RELEASE_RE.match(version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def is_downgrade(pinned: str, new: str) -> bool:
    old_r, new_r = release(pinned), release(new)
    return bool(old_r and new_r) and new_r < old_r


def index_versions(pip_output: str) -> list[str]:
    """The versions pip lists in "(from versions: ...)" when a pin matches
    none, newest first."""
    m = re.search(r"\(from versions: ([^)]*)\)", pip_output)
    if m is None:
        return []
    found = [v.strip() for v in m.group(1).split(",") if v.strip()]
    return sorted(found, key=lambda v: (release(v), v), reverse=True)


def download_failure(version: str, pip_output: str, pinned: str) -> str:
    """Why ``pip download vllm==version`` failed, with what --to can be."""
    versions = index_versions(pip_output)
    if versions:
        newer = [v for v in versions if release(v) > release(pinned)]
        shown = ", ".join((newer or versions)[:5])
        which = "newer than the pinned" if newer else "none newer than the pinned"
        why = (
            f"vllm {version} is not on the package index ({which} {pinned}; "
            f"newest: {shown})"
        )
    else:
        tail = pip_output.strip().splitlines()[-1:]
        why = f"pip download vllm=={version} failed: {' '.join(tail) or 'no output'}"
    return f"{why}; {FORMS}"


def fetch_version(version: str, cache: Path, pinned: str = "") -> Path:
    """The wheel of vLLM ``version`` in ``cache`` (or its ``vllm-VERSION``
    directory), downloaded by pip when missing (pip's own cache avoids a
    second download)."""
    dest = cache / f"vllm-{version}"
    pattern = f"vllm-{version}-*.whl"
    found = sorted(cache.glob(pattern)) or sorted(dest.glob(pattern))
    if not found:
        made = not dest.exists()
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
        print(f"rebase: downloading vllm {version}: {' '.join(cmd)}", flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            if made:
                shutil.rmtree(dest, ignore_errors=True)
            raise RebaseError(
                download_failure(version, run.stderr + run.stdout, pinned)
            )
        found = sorted(dest.glob(pattern))
    if len(found) != 1:
        raise RebaseError(f"{dest}: expected one vllm-{version} wheel, found {found}")
    return found[0]


def resolve_new_base(
    spec: str,
    module: str,
    cache: Path,
    pinned: str = "",
    core_paths: Iterable[str] = (),
) -> NewBase:
    """The base ``spec`` names: its module files, and the core files of
    ``core_paths`` it holds."""
    path = Path(spec)
    if path.suffix == ".whl":
        if not path.is_file():
            raise RebaseError(f"{spec}: no such wheel; {FORMS}")
        return new_base_from_wheel(path, module, core_paths)
    if path.is_dir():
        return new_base_from_source(path, module, core_paths)
    if _VERSION_RE.match(spec):
        return new_base_from_wheel(
            fetch_version(spec, cache, pinned), module, core_paths
        )
    raise RebaseError(
        f"--to {spec!r}: no such wheel or directory, and no version; {FORMS}"
    )
