"""The image build driver: build args, engine choice, exact commands; fake
engines on a private PATH stand in for docker / podman / buildah."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest

from vllm_overlay.cli import main
from vllm_overlay.image.build import ImageError, build_args, default_tag, run_image
from vllm_overlay.series.patch_series import load_series
from vllm_overlay.series.pin import PIN_FILE, load_pin

REPO = Path(__file__).resolve().parents[2]


def fake_engine(
    bin_dir: Path, name: str, info_ok: bool = True, build_ok: bool = True
) -> Path:
    """An engine that records its arguments, one call per line."""
    bin_dir.mkdir(exist_ok=True)
    log = bin_dir / f"{name}.calls"
    script = bin_dir / name
    script.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$*" >> {shlex.quote(str(log))}\n'
        f'[ "$1" = info ] && exit {0 if info_ok else 1}\n'
        f'[ "$1" = build ] || [ "$1" = bud ] && exit {0 if build_ok else 1}\n'
        "exit 0\n"
    )
    script.chmod(0o755)
    return log


def only(bin_dir: Path):  # noqa: ANN201 - a `which` over one directory
    return lambda name: shutil.which(name, path=str(bin_dir))


def expected_args() -> dict[str, str]:
    pin = load_pin(REPO / PIN_FILE)
    series = load_series(REPO)
    return build_args(REPO, pin, series)


def test_build_args_come_from_pin_series_and_git() -> None:
    pin = load_pin(REPO / PIN_FILE)
    series = load_series(REPO)
    args = build_args(REPO, pin, series)
    assert args["BASE_IMAGE"] == pin.image.pull_ref
    assert args["VLLM_VERSION"] == pin.vllm.version
    assert args["VLLM_COMMIT"] == pin.vllm.git_commit
    assert args["SERIES_ID"] == series.series_id
    assert args["SERIES_PATCHES"] == ",".join(p.slug for p in series.patches)
    assert args["VCS_REVISION"].split("-")[0] and len(args["VCS_REVISION"]) >= 40
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    for key in args:
        assert f"ARG {key}" in dockerfile, key
        assert "${" + key + "}" in dockerfile, key


def test_dry_run_prints_the_exact_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines: list[str] = []
    rc = run_image(
        REPO, "reg/img:t", push=True, dry_run=True, which=only(tmp_path),
        say=lines.append,
    )  # fmt: skip
    assert rc == 0
    text = "\n".join(lines)
    assert "no working engine here (docker: not installed;" in text
    build = shlex.split(lines[-2])
    assert build[:6] == [
        "docker",
        "build",
        "--file",
        f"{REPO}/docker/Dockerfile",
        "--tag",
        "reg/img:t",
    ]
    args = expected_args()
    pairs = [build[i + 1] for i, a in enumerate(build) if a == "--build-arg"]
    assert pairs == [f"{k}={v}" for k, v in args.items()]
    assert build[-1] == str(REPO)
    assert shlex.split(lines[-1]) == ["docker", "push", "reg/img:t"]
    for key, value in args.items():
        assert f"#   {key}={value}" in lines


def test_cli_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--repo", str(REPO), "image", "--dry-run"]) == 0
    out = capsys.readouterr().out
    pin, series = load_pin(REPO / PIN_FILE), load_series(REPO)
    assert f"--tag {default_tag(pin, series)}" in out
    assert f"BASE_IMAGE={pin.image.pull_ref}" in out


def test_no_engine_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(
        ImageError,
        match="no container engine can build here: docker: not installed; "
        "podman: not installed; buildah: not installed",
    ):
        run_image(REPO, None, False, False, which=only(tmp_path), say=lambda _: None)


def test_cli_exits_non_zero_without_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["--repo", str(REPO), "image"]) != 0
    assert "no container engine can build here" in capsys.readouterr().err


def test_builds_and_pushes_with_the_first_working_engine(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    docker = fake_engine(bin_dir, "docker", info_ok=False)  # no daemon
    podman = fake_engine(bin_dir, "podman")
    lines: list[str] = []
    rc = run_image(REPO, "r/i:t", True, False, which=only(bin_dir), say=lines.append)
    assert rc == 0
    assert docker.read_text() == "info\n"
    calls = podman.read_text().splitlines()
    assert calls[0] == "info"
    assert calls[1].startswith(f"build --file {REPO}/docker/Dockerfile --tag r/i:t ")
    assert calls[2] == "push r/i:t"


def test_buildah_uses_bud(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    buildah = fake_engine(bin_dir, "buildah")
    run_image(REPO, "r/i:t", False, False, which=only(bin_dir), say=lambda _: None)
    assert buildah.read_text().splitlines()[1].startswith("bud --file ")


def test_a_failed_build_fails_and_does_not_push(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    docker = fake_engine(bin_dir, "docker", build_ok=False)
    with pytest.raises(ImageError, match="`docker build` failed"):
        run_image(REPO, "r/i:t", True, False, which=only(bin_dir), say=lambda _: None)
    assert not any(c.startswith("push") for c in docker.read_text().splitlines())
