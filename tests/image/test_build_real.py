"""docker/Dockerfile built for real with the machine's engine (buildah here),
from tiny bases made of the stand-in's root filesystem and the pinned MoRIIO
files: the build fails when pip cannot install into the base's Python, when
a pinned file of the base differs, when the series does not apply, and when
the in-image checks fail (vLLM's version, the connector's import); a change
to our sources reuses the cached layers before it.

These build images (root, buildah or docker, Debian's and PyPI's packages):
`nox -s image-standin` runs them with VLLM_OVERLAY_IMAGE_BUILDS=1; elsewhere
tests/image/conftest.py leaves this file out of the collection.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.image.conftest import ENGINE, REPO
from vllm_overlay.image.engine import Engine, choose_engine
from vllm_overlay.image.standin import (
    PIP,
    SETUPTOOLS,
    Inputs,
    assemble_context,
    make_rootfs,
    make_wheelhouse,
)
from vllm_overlay.series.patch_series import Series
from vllm_overlay.series.pin import PIN_FILE, load_pin
from vllm_overlay.tree.materialize import base_from_wheel, materialize

TINY = REPO / "tests" / "image" / "fixtures" / "Containerfile.tiny"
CACHE = REPO / ".nox-cache" / "standin"
# What the build context holds (.dockerignore) and the driver reads.
CHECKOUT = (
    ".dockerignore", "pyproject.toml", "README.md", PIN_FILE, "patches",
    "vllm_overlay", "docker",
)  # fmt: skip


@pytest.fixture(scope="module")
def engine() -> Engine:
    choice = choose_engine()
    if choice.engine is None:
        pytest.fail(f"no engine can build here: {choice.explain()}")
    return choice.engine


@pytest.fixture(scope="module")
def inputs() -> Inputs:
    say = print
    return Inputs(
        make_rootfs(CACHE, say), make_wheelhouse(REPO, CACHE, say, [PIP, SETUPTOOLS])
    )


@pytest.fixture(scope="module")
def base_files() -> dict[str, str]:
    wheel = os.environ.get("VLLM_OVERLAY_WHEEL")
    if not wheel:
        pytest.fail("VLLM_OVERLAY_WHEEL must name the pinned vLLM wheel")
    return base_from_wheel(Path(wheel), load_pin(REPO / PIN_FILE))


def run(argv: list[str], timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False
    )


TinyBase = Callable[..., str]


@pytest.fixture(scope="module")
def tiny_base(
    engine: Engine,
    inputs: Inputs,
    base_files: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> TinyBase:
    """Build a tiny base; ``mutate`` edits its site-packages first."""

    def make(
        name: str,
        *,
        externally_managed: bool = False,
        version: str = "0.33.0",
        mutate: Callable[[Path], None] | None = None,
    ) -> str:
        context = tmp_path_factory.mktemp(f"tiny-{name}")
        assemble_context(context, TINY, inputs)
        site = context / "site"
        (site / "vllm" / "distributed").mkdir(parents=True)
        (site / "vllm" / "__init__.py").write_text(f'__version__ = "{version}"\n')
        dist = site / "vllm-0.33.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n"
        )
        materialize(base_files, Series(REPO, ()), site, overlay=False)
        if mutate is not None:
            mutate(site)
        tag = f"localhost/vllm-moriio-overlay-tiny:{name}"
        args = {
            "PIP": PIP,
            "SETUPTOOLS": SETUPTOOLS,
            "EXTERNALLY_MANAGED": "yes" if externally_managed else "no",
        }
        out = run(
            engine.build(str(context / "Containerfile"), [tag], args, str(context))
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return tag

    return make


def checkout_copy(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in CHECKOUT:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(
                src, dest / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(src, dest / name)
    return dest


def build(
    repo: Path, base: str, name: str, engine: Engine
) -> subprocess.CompletedProcess[str]:
    """`vllm-overlay image build` from ``base``, as a user runs it."""
    return run(
        [sys.executable, "-m", "vllm_overlay.cli", "--repo", str(repo),
         "image", "build", "--engine", engine.name, "--base", base,
         "--tag", f"localhost/vllm-moriio-overlay-test:{name}"],
    )  # fmt: skip


def containers(engine: Engine) -> set[str]:
    if not engine.is_buildah:
        return set()
    return set(run([engine.path, "containers", "--quiet"]).stdout.split())


def failed_at(out: subprocess.CompletedProcess[str], engine: Engine) -> str:
    text = out.stdout + out.stderr
    verb = "bud" if engine.is_buildah else "build"
    assert out.returncode != 0, text[-3000:]
    assert (
        f"`{engine.name} {verb}` failed for localhost/vllm-moriio-overlay-test" in text
    )
    return text


def test_pip_cannot_install_into_an_externally_managed_python(
    tiny_base: TinyBase, engine: Engine, tmp_path: Path
) -> None:
    base = tiny_base("externally-managed", externally_managed=True)
    before = containers(engine)
    text = failed_at(build(REPO, base, "externally-managed", engine), engine)
    assert containers(engine) == before  # the failed step's container is gone
    assert "externally-managed-environment" in text, text[-3000:]
    assert "apply-overlay:" not in text  # stopped at the first pip install


def test_a_pinned_file_that_differs_fails_the_build(
    tiny_base: TinyBase, engine: Engine
) -> None:
    def edit(site: Path) -> None:
        f = site / ENGINE
        f.write_text(f.read_text() + "# edited in the base\n")

    base = tiny_base("edited", mutate=edit)
    text = failed_at(build(REPO, base, "edited", engine), engine)
    assert f"{ENGINE}: does not match the pinned base" in text, text[-3000:]
    assert "every pinned file is overlaid" not in text


def test_a_series_that_does_not_apply_fails_the_build(
    tiny_base: TinyBase, engine: Engine, tmp_path: Path
) -> None:
    repo = checkout_copy(tmp_path / "repo")
    patch = sorted((repo / "patches").glob("0001-*.patch"))[0]
    text = patch.read_text()
    # The first context line of the first hunk no longer matches the base.
    m = re.search(r"^@@ .*\n (.+)$", text, re.MULTILINE)
    assert m is not None
    edited = text[: m.start(1)] + "#" + text[m.start(1) :]
    patch.write_text(edited)
    base = tiny_base("good")
    out = failed_at(build(repo, base, "no-apply", engine), engine)
    line = next((x for x in out.splitlines() if f"error: {patch.name}: " in x), "")
    assert "does not apply" in line, out[-3000:]
    assert "every pinned file is overlaid" not in out


def test_the_build_checks_the_version_and_the_connector_import(
    tiny_base: TinyBase, engine: Engine
) -> None:
    # The series applies, but this vllm says 0.32.0 and has no torch: the
    # checks in the same RUN step fail the build.
    base = tiny_base("wrong-version", version="0.32.0")
    text = failed_at(build(REPO, base, "wrong-version", engine), engine)
    assert "apply-overlay: every pinned file is overlaid" in text, text[-3000:]
    assert "ok   overlay" in text
    assert (
        "FAIL  vllm-version      vllm.__version__ 0.32.0, distribution 0.33.0; "
        "the pin is 0.33.0"
    ) in text
    assert "FAIL  connector-import  import vllm.distributed" in text
    assert "verify: FAILED" in text


def steps(output: str) -> dict[str, bool]:
    """Each build step (buildah's `STEP n/m: ...` line) -> taken from cache."""
    out: dict[str, bool] = {}
    current = ""
    for line in output.splitlines():
        if line.startswith("STEP "):
            current = line.split(": ", 1)[1]
            out[current] = False
        elif line.startswith("--> Using cache") and current:
            out[current] = True
    return out


def test_a_source_change_reuses_the_layers_before_it(
    tiny_base: TinyBase, engine: Engine, tmp_path: Path
) -> None:
    if engine.name == "docker":
        pytest.skip("reads buildah/podman step output")
    base = tiny_base("good")
    repo = checkout_copy(tmp_path / "repo")
    build(repo, base, "cache", engine)  # warm (fails at the checks: no torch)
    module = repo / "vllm_overlay" / "image" / "verify.py"
    module.write_text(module.read_text() + "\n# a source change\n")
    again = steps(build(repo, base, "cache", engine).stdout)
    requirements = next(s for s in again if "-r /opt/vllm-moriio-overlay/docker/" in s)
    package = next(s for s in again if "--no-deps /opt/vllm-moriio-overlay" in s)
    source = next(s for s in again if s.startswith("COPY vllm_overlay"))
    assert again[requirements], again  # router and dependencies: cached
    assert not again[source] and not again[package], again  # ours: rebuilt
