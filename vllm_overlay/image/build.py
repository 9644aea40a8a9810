"""`vllm-overlay image`: build (and push) the ROCm image with the series.

The build args come from the pin (base image, vLLM version and commit), the
series (id and patch ids) and git (source, revision); docker/Dockerfile
turns them into OCI labels. Builds with docker, podman or buildah, whichever
is present and working; `--dry-run` prints the exact commands instead.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from vllm_overlay import __version__
from vllm_overlay.errors import OverlayError
from vllm_overlay.series.patch_series import Series, load_series
from vllm_overlay.series.pin import PIN_FILE, Pin, load_pin

ENGINES = ("docker", "podman", "buildah")
DOCKERFILE = "docker/Dockerfile"
IMAGE_NAME = "vllm-moriio-overlay"

Which = Callable[[str], str | None]


class ImageError(OverlayError):
    """No engine can build, or a build/push failed."""


def git(repo: Path, *args: str) -> str:
    """One git query; empty when git or the repository is unavailable."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def revision(repo: Path) -> str:
    rev = git(repo, "rev-parse", "HEAD")
    if rev and git(repo, "status", "--porcelain", "--untracked-files=no"):
        rev += "-dirty"
    return rev


def build_args(repo: Path, pin: Pin, series: Series) -> dict[str, str]:
    """Every build arg of docker/Dockerfile, in a stable order."""
    return {
        "BASE_IMAGE": pin.image.pull_ref,
        "VCS_SOURCE": git(repo, "remote", "get-url", "origin"),
        "VCS_REVISION": revision(repo),
        "VLLM_VERSION": pin.vllm.version,
        "VLLM_COMMIT": pin.vllm.git_commit,
        "SERIES_ID": series.series_id,
        "SERIES_PATCHES": ",".join(p.slug for p in series.patches),
        "OVERLAY_VERSION": __version__,
    }


def default_tag(pin: Pin, series: Series) -> str:
    return f"{IMAGE_NAME}:v{pin.vllm.version}-{series.series_id}"


def engine_works(path: str) -> bool:
    """Can this engine build here (daemon reachable, storage usable)?"""
    try:
        probe = subprocess.run(
            [path, "info"], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def find_engine(
    preferred: str | None = None,
    which: Which = shutil.which,
    works: Callable[[str], bool] = engine_works,
) -> tuple[str | None, list[str]]:
    """The path of the first engine that is installed and works, and why
    the others were passed over."""
    notes: list[str] = []
    for name in [preferred] if preferred else ENGINES:
        path = which(name)
        if path is None:
            notes.append(f"{name}: not installed")
        elif not works(path):
            notes.append(f"{name}: installed at {path} but `{name} info` fails")
        else:
            return path, notes
    return None, notes


def build_command(engine: str, tag: str, args: dict[str, str], repo: Path) -> list[str]:
    verb = ["bud"] if Path(engine).name == "buildah" else ["build"]
    argv = [engine, *verb, "--file", str(repo / DOCKERFILE), "--tag", tag]
    for key, value in args.items():
        argv += ["--build-arg", f"{key}={value}"]
    return [*argv, str(repo)]


def push_command(engine: str, tag: str) -> list[str]:
    return [engine, "push", tag]


def commands(
    engine: str, tag: str, args: dict[str, str], repo: Path, push: bool
) -> list[list[str]]:
    out = [build_command(engine, tag, args, repo)]
    if push:
        out.append(push_command(engine, tag))
    return out


def run_image(
    repo: Path,
    tag: str | None,
    push: bool,
    dry_run: bool,
    engine: str | None = None,
    which: Which = shutil.which,
    works: Callable[[str], bool] = engine_works,
    say: Callable[[str], None] = print,
) -> int:
    pin = load_pin(repo / PIN_FILE)
    series = load_series(repo)
    args = build_args(repo, pin, series)
    tag = tag or default_tag(pin, series)
    found, notes = find_engine(engine, which, works)
    if dry_run:
        shown = found or engine or ENGINES[0]
        say(f"# image {tag} from {args['BASE_IMAGE']} (series {args['SERIES_ID']})")
        if found is None:
            say(f"# no working engine here ({'; '.join(notes)}); shown with {shown}")
        say("# build args:")
        for key, value in args.items():
            say(f"#   {key}={value}")
        for argv in commands(shown, tag, args, repo, push):
            say(shlex.join(argv))
        return 0
    if found is None:
        raise ImageError(
            "no container engine can build here: "
            + "; ".join(notes)
            + " (install docker, podman or buildah, or use --dry-run)"
        )
    for argv in commands(found, tag, args, repo, push):
        say(f"$ {shlex.join(argv)}")
        if subprocess.run(argv, check=False).returncode != 0:
            what = f"{Path(argv[0]).name} {argv[1]}"
            raise ImageError(f"`{what}` failed for {tag}")
    say(f"image: {tag} (series {args['SERIES_ID']}){' pushed' if push else ''}")
    return 0
