"""docker/Dockerfile (issue 41, finding 7): vLLM runs as a non-root user in
the groups ROCm's devices belong to, and every pip install fetches only
exact versions whose sha256 the repository holds."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.image.conftest import REPO
from tests.image.dockerfile import instructions
from vllm_overlay.e2e.config import IMAGE_UID, RENDER_GID, UNPRIVILEGED_FLAGS
from vllm_overlay.image.build import IMAGE_REPO

REQUIREMENT = re.compile(
    r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!-]+)"
    r"(?P<hashes>(\s+--hash=sha256:[0-9a-f]{64})+)"
)


def requirement_lines(path: Path) -> list[str]:
    """The requirements of a pip requirements file, continuation lines
    joined, comments and blank lines left out."""
    text = path.read_text().replace("\\\n", " ")
    lines = [line.split(" #")[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def pip_installs() -> list[list[str]]:
    """The words of every `pip install` command of a RUN step."""
    out = []
    for word, rest in instructions():
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", rest):
            if not re.search(r"\bpip\b.*\binstall\b", command):
                continue
            words = shlex.split(command)
            if "pip" in words and "install" in words:
                out.append(words[words.index("install") + 1 :])
    return out


def test_vllm_runs_as_a_non_root_user() -> None:
    steps = instructions()
    users = [i for i, (word, _) in enumerate(steps) if word == "USER"]
    assert users, "no USER: the image runs as root"
    last_run = max(i for i, (word, _) in enumerate(steps) if word == "RUN")
    user = steps[users[-1]][1]
    # The last USER holds for the image; every RUN before it ran as root.
    assert users[-1] > last_run
    assert user.split(":")[0] == str(IMAGE_UID)
    creates = [rest for word, rest in steps if word == "RUN" and "useradd" in rest]
    assert len(creates) == 1
    useradd = creates[0][creates[0].index("useradd") :].split("&&")[0].split()
    assert useradd[useradd.index("--uid") + 1] == str(IMAGE_UID)
    # ROCm's devices: /dev/kfd and /dev/dri/renderD* (render), /dev/dri/card*
    # (video); the e2e launch adds the same groups to every server.
    assert useradd[useradd.index("--groups") + 1] == "video,render"
    flags = " ".join(UNPRIVILEGED_FLAGS)
    # render by the node's gid (filled in on the node: e2e/config.RENDER_GID).
    assert "--group-add video" in flags and f"--group-add {RENDER_GID}" in flags


def test_every_pip_install_is_pinned_with_hashes() -> None:
    installs = pip_installs()
    assert len(installs) == 2
    for args in installs:
        if "-r" in args:
            # From an index: only what the file pins, with its hashes, and
            # nothing else (no dependencies, no build environment).
            assert {"--require-hashes", "--no-deps", "--no-build-isolation"} <= set(
                args
            ), args
            file = args[args.index("-r") + 1]
            assert file.startswith(f"{IMAGE_REPO}/docker/"), file
            local = REPO / "docker" / Path(file).name
            lines = requirement_lines(local)
            assert lines, local
            for line in lines:
                m = REQUIREMENT.fullmatch(line)
                assert m is not None, f"{local}: not pinned with hashes: {line}"
        else:
            # This package, from the build context: no index at all.
            assert {"--no-index", "--no-deps", "--no-build-isolation"} <= set(args)
            assert args[-1] == IMAGE_REPO


def test_the_requirements_pin_each_platform_and_the_sdist() -> None:
    # Platform wheels (msgspec) need one hash per Python of the bases
    # (ROCm 3.12, stand-in 3.11), plus the sdist; an abi3 or pure wheel needs
    # one, plus the sdist.
    found = {
        m.group("name"): (m.group("version"), m.group("hashes").split())
        for m in (
            REQUIREMENT.fullmatch(line)
            for line in requirement_lines(REPO / "docker" / "requirements-image.txt")
        )
        if m is not None
    }
    assert set(found) == {"msgspec", "tomli-w", "vllm-router"}
    assert found["msgspec"][0] == "0.23.0" and len(found["msgspec"][1]) == 3
    assert len(found["tomli-w"][1]) == 2 and len(found["vllm-router"][1]) == 2
    for _, hashes in found.values():
        assert len(set(hashes)) == len(hashes)
