"""The image build driver: engine choice and why, the base pulled as its own
step and pinned by digest, build args, labels, the check from inside, push
only after the checks. Fake engines (tests/image/fake_engine.py) on a
private PATH stand in for docker, podman and buildah; the real build runs in
`nox -s image-standin`."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import msgspec
import pytest

from tests.image import fake_engine
from tests.repo import REPO
from vllm_overlay.cli import main
from vllm_overlay.image.build import (
    LABELS,
    ImageError,
    ImageReport,
    base_reference,
    build_args,
    build_image,
    default_tag,
    image_tags,
)
from vllm_overlay.series.patch_series import load_series
from vllm_overlay.series.pin import PIN_FILE, load_pin

BASE = load_pin(REPO / "pin.toml").image.reference
DIGEST = "sha256:" + "cd" * 32


def only(bin_dir: Path):  # noqa: ANN201 - a `which` over one directory
    return lambda name: shutil.which(name, path=str(bin_dir))


def no_probe(path: str) -> tuple[bool, str]:
    raise AssertionError("not probed")


def fake_probe(path: str) -> tuple[bool, str]:
    import subprocess

    out = subprocess.run([path, "info"], capture_output=True, text=True, check=False)
    return out.returncode == 0, out.stderr.strip()


def build(bin_dir: Path, lines: list[str], **kwargs: object) -> ImageReport | None:
    return build_image(
        REPO, which=only(bin_dir), probe=fake_probe, say=lines.append, **kwargs
    )  # type: ignore[arg-type]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for knob in ("FAKE_INFO", "FAKE_BASE", "FAKE_PULL", "FAKE_BUILD", "FAKE_VERIFY"):
        monkeypatch.delenv(knob, raising=False)
    monkeypatch.setenv("FAKE_DIGEST", f"vllm/vllm-openai-rocm@{DIGEST}")
    monkeypatch.delenv("BUILDAH_ISOLATION", raising=False)
    return monkeypatch


@pytest.fixture
def docker_without_base(tmp_path: Path, env: pytest.MonkeyPatch) -> Path:
    """A fake docker in ``tmp_path`` that does not hold the base image yet."""
    docker = fake_engine.install(tmp_path, "docker")
    env.setenv("FAKE_BASE", "absent")
    return docker


def test_build_args_come_from_pin_series_and_git() -> None:
    pin, series = load_pin(REPO / PIN_FILE), load_series(REPO)
    args = build_args(REPO, pin, series, base_reference(pin, None).with_digest(DIGEST))
    assert args["BASE_IMAGE"] == f"docker.io/vllm/vllm-openai-rocm@{DIGEST}"
    assert args["BASE_NAME"] == BASE
    assert args["BASE_DIGEST"] == DIGEST
    assert args["VLLM_VERSION"] == pin.vllm.version
    assert args["VLLM_COMMIT"] == pin.vllm.git_commit
    assert args["SERIES_ID"] == series.series_id
    assert args["SERIES_PATCHES"] == ",".join(p.slug for p in series.patches)
    assert args["VCS_REVISION"].split("-")[0] and len(args["VCS_REVISION"]) >= 40


def test_every_label_the_driver_checks_is_the_dockerfiles() -> None:
    args = {key: f"<{key}>" for key in LABELS.values()}
    labels = fake_engine.dockerfile_labels(args)
    for label, arg in LABELS.items():
        assert labels[label] == f"<{arg}>", label


def test_build_args_are_declared_after_the_last_run() -> None:
    # A new commit or series changes these args: declared before a RUN they
    # would invalidate that RUN's cached layer.
    lines = (REPO / "docker" / "Dockerfile").read_text().splitlines()
    last_run = max(i for i, line in enumerate(lines) if line.startswith("RUN "))
    for arg in LABELS.values():
        declared = [i for i, line in enumerate(lines) if line.startswith(f"ARG {arg}")]
        assert declared and min(declared) > last_run, arg


def test_dry_run_says_why_it_picked_buildah(
    tmp_path: Path, env: pytest.MonkeyPatch
) -> None:
    fake_engine.install(tmp_path, "docker")
    fake_engine.install(tmp_path, "buildah")
    env.setenv("FAKE_INFO", "fail")  # both answer `info` with an error...
    lines: list[str] = []
    build(tmp_path, lines, dry=True)
    text = "\n".join(lines)
    assert "docker: `docker info` fails at" in text
    assert "(Cannot connect to the docker daemon)" in text
    env.delenv("FAKE_INFO")  # ...now both work: docker first
    lines.clear()
    build(tmp_path, lines, dry=True)
    assert "docker: works at" in "\n".join(lines)


def test_dry_run_buildah_chroot_without_an_oci_runtime(
    tmp_path: Path, env: pytest.MonkeyPatch
) -> None:
    fake_engine.install(tmp_path, "buildah")
    lines: list[str] = []
    build(tmp_path, lines, dry=True)
    engine_line = next(x for x in lines if x.startswith("# engine:"))
    assert "podman: not installed" in engine_line
    assert "buildah: works at" in engine_line
    assert "no OCI runtime (runc, crun) installed): chosen" in engine_line
    bud = next(x for x in lines if " bud " in x)
    assert "--layers --force-rm --pull=never --isolation=chroot" in bud
    assert f"--build-arg BASE_IMAGE={BASE}" in bud
    assert any(x.endswith(f"pull {BASE}") for x in lines)
    run = next(x for x in lines if " run " in x)
    assert "vllm-overlay --repo /opt/vllm-moriio-overlay image verify --json" in run


def test_cli_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--repo", str(REPO), "image", "build", "--dry-run"]) == 0
    out = capsys.readouterr().out
    pin, series = load_pin(REPO / PIN_FILE), load_series(REPO)
    assert f"--tag {default_tag(pin, series)} " in out
    assert f"--tag vllm-moriio-overlay:v{pin.vllm.version}-overlay " in out
    assert f"BASE_IMAGE={BASE}" in out


def test_the_tags_a_build_applies() -> None:
    pin, series = load_pin(REPO / PIN_FILE), load_series(REPO)
    exact, moving = (
        f"v{pin.vllm.version}-{series.series_id}",
        f"v{pin.vllm.version}-overlay",
    )
    assert image_tags(None, pin, series) == [
        f"vllm-moriio-overlay:{exact}",
        f"vllm-moriio-overlay:{moving}",
    ]
    assert image_tags("reg:5000/team/x", pin, series) == [
        f"reg:5000/team/x:{exact}",
        f"reg:5000/team/x:{moving}",
    ]
    assert image_tags("reg:5000/team/x:mine", pin, series) == ["reg:5000/team/x:mine"]


def test_example_configs_name_the_tag_the_build_pushes() -> None:
    # `nox -s image -- --tag registry.example.com/vllm-moriio-overlay --push`
    pin, series = load_pin(REPO / PIN_FILE), load_series(REPO)
    pushed = image_tags("registry.example.com/vllm-moriio-overlay", pin, series)
    examples = sorted((REPO / "examples").glob("*.toml"))
    assert examples
    for example in examples:
        image = tomllib.loads(example.read_text())["container"]["image"]
        assert image in pushed, f"{example.name}: {image} is not one of {pushed}"


def test_no_engine_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(
        ImageError,
        match="no container engine can build here: docker: not installed; "
        "podman: not installed; buildah: not installed",
    ):
        build_image(REPO, which=only(tmp_path), probe=no_probe, say=lambda _: None)


def test_cli_exits_non_zero_without_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["--repo", str(REPO), "image", "build"]) != 0
    assert "no container engine can build here" in capsys.readouterr().err


def test_pull_digest_build_labels_verify_push(
    tmp_path: Path, docker_without_base: Path
) -> None:
    docker = docker_without_base
    lines: list[str] = []
    report = build(tmp_path, lines, tag="r/i", push=True)
    assert report is not None and report.ok and report.pushed
    assert report.tags == image_tags(
        "r/i", load_pin(REPO / PIN_FILE), load_series(REPO)
    )
    verbs = [
        c[0] if c[0] != "image" else f"image {c[1]}" for c in fake_engine.calls(docker)
    ]
    assert verbs == [
        "info",
        "image inspect",  # present?
        "pull",
        "image inspect",  # digest
        "build",
        "image inspect",  # labels
        "run",
        "image inspect",  # size
        "push",
        "push",
    ]
    by_call = fake_engine.calls(docker)
    assert [c[1] for c in by_call[-2:]] == report.tags
    assert by_call[2] == ["pull", BASE]
    build_call = by_call[4]
    assert f"BASE_IMAGE=docker.io/vllm/vllm-openai-rocm@{DIGEST}" in build_call
    assert f"BASE_DIGEST={DIGEST}" in build_call
    # The labels also as --label (buildah 1.28 caches LABEL steps by text).
    series_id = load_series(REPO).series_id
    assert f"ai.vllm.moriio-overlay.series.id={series_id}" in build_call
    assert build_call[build_call.index(f"BASE_DIGEST={DIGEST}") + 1 :].count(
        "--label"
    ) == len(LABELS)
    assert by_call[6][:4] == ["run", "--rm", "--entrypoint", "vllm-overlay"]
    assert report.base_digest == DIGEST
    assert report.labels["org.opencontainers.image.base.digest"] == DIGEST
    assert report.labels["org.opencontainers.image.base.name"] == BASE
    assert "pin.toml records no digest; --record-digest writes" in "\n".join(lines)
    assert lines[-1].startswith(f"image: ok, {report.tag} (2.52 GB) from ")


def test_a_base_with_a_pinned_digest_is_pulled_by_digest(
    tmp_path: Path, docker_without_base: Path
) -> None:
    docker = docker_without_base
    lines: list[str] = []
    build(tmp_path, lines, tag="r/i:t", base=f"reg:5000/team/rocm:v1@{DIGEST}")
    by_call = fake_engine.calls(docker)
    assert by_call[2] == ["pull", f"reg:5000/team/rocm@{DIGEST}"]
    assert not any("Digest" in " ".join(c) for c in by_call)  # known already
    assert "BASE_NAME=reg:5000/team/rocm:v1" in by_call[3]


def test_record_digest_writes_the_pin(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(
        REPO, repo, ignore=shutil.ignore_patterns(".*", "tests", "*.egg-info")
    )
    fake_engine.install(tmp_path / "bin", "podman")
    env.setenv("FAKE_DIGEST", DIGEST)  # podman prints the bare digest
    build_image(
        repo, tag="r/i:t", record=True, which=only(tmp_path / "bin"),
        probe=fake_probe, say=lambda _: None,
    )  # fmt: skip
    pin = load_pin(repo / PIN_FILE)
    assert pin.image.digest == DIGEST
    assert pin.image.pull_ref == f"docker.io/vllm/vllm-openai-rocm@{DIGEST}"


def test_a_failed_check_inside_fails_and_does_not_push(
    tmp_path: Path, env: pytest.MonkeyPatch
) -> None:
    buildah = fake_engine.install(tmp_path, "buildah")
    env.setenv("FAKE_VERIFY", "fail")
    lines: list[str] = []
    with pytest.raises(ImageError, match="fails its checks"):
        build(tmp_path, lines, tag="r/i:t", push=True)
    verbs = [c[0] for c in fake_engine.calls(buildah)]
    assert "push" not in verbs
    assert "rm" in verbs  # the throwaway container is removed
    assert any("FAIL  connector-import" in x for x in lines)
    assert lines[-1].startswith("image: FAILED, r/i:t")


def test_verify_without_a_verdict_shows_the_output(
    tmp_path: Path, env: pytest.MonkeyPatch
) -> None:
    fake_engine.install(tmp_path, "docker")
    env.setenv("FAKE_VERIFY", "garbage")
    with pytest.raises(
        ImageError, match="(?s)gave no verdict.*ImportError: no vllm_overlay"
    ):
        build(tmp_path, [], tag="r/i:t")


def test_a_failed_build_fails_and_does_not_push(
    tmp_path: Path, env: pytest.MonkeyPatch
) -> None:
    docker = fake_engine.install(tmp_path, "docker")
    env.setenv("FAKE_BUILD", "fail")
    with pytest.raises(ImageError, match=r"`docker build` failed for r/i:t after"):
        build(tmp_path, [], tag="r/i:t", push=True)
    assert "push" not in [c[0] for c in fake_engine.calls(docker)]


def test_an_unpullable_base_is_its_own_error(
    tmp_path: Path, env: pytest.MonkeyPatch, docker_without_base: Path
) -> None:
    docker = docker_without_base
    env.setenv("FAKE_PULL", "fail")
    with pytest.raises(ImageError, match=f"cannot pull the base {BASE} with docker"):
        build(tmp_path, [], tag="r/i:t")
    assert "build" not in [c[0] for c in fake_engine.calls(docker)]


def test_the_report_file(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    fake_engine.install(tmp_path, "docker")
    out = tmp_path / "report" / "image.json"
    build(tmp_path, [], tag="r/i:t", report_path=out)
    report = msgspec.json.decode(out.read_bytes(), type=ImageReport)
    assert report.tag == "r/i:t" and report.verification is not None
    assert json.loads(out.read_text())["base_digest"] == DIGEST


def test_cli_dry_run_without_the_series(capsys: pytest.CaptureFixture[str]) -> None:
    # The A/B base: the same build, the series not applied, the banner
    # plugin in; labelled and tagged as such, checked as the base.
    argv = ["--repo", str(REPO), "image", "build", "--dry-run", "--series", "none"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    pin = load_pin(REPO / PIN_FILE)
    tag = f"vllm-moriio-overlay:v{pin.vllm.version}-base"
    assert out.splitlines()[0] == (
        f"# image {tag} from {BASE} (no series: the banner plugin and the base's "
        "MoRIIO files, the A/B base)"
    )
    assert "#   OVERLAY_SERIES=none" in out and "#   SERIES_ID=none" in out
    assert "#   SERIES_PATCHES=\n" in out
    build = next(x for x in out.splitlines() if "--build-arg" in x)
    assert f"--tag {tag} " in build and "-overlay " not in build
    assert "--build-arg OVERLAY_SERIES=none" in build
    assert "--label ai.vllm.moriio-overlay.series.id=none" in build
    assert out.rstrip().endswith("image verify --json --series none --rdma")
    # The default build applies the series.
    assert main(["--repo", str(REPO), "image", "build", "--dry-run"]) == 0
    default = capsys.readouterr().out
    assert "--build-arg OVERLAY_SERIES=apply" in default
    # The new image is checked for MoRI, a NIC provider and the toy proxy.
    assert default.rstrip().endswith("image verify --json --rdma")


def test_an_unknown_series_mode_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--repo", str(REPO), "image", "build", "--dry-run", "--series", "half"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --series: invalid choice: 'half'")
    assert err.count("\n") == 1
