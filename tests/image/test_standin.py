"""The stand-in base's inputs and its cache key (the build itself runs in
`nox -s image-standin`)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from tests.image.conftest import REPO
from vllm_overlay.image import standin
from vllm_overlay.image.engine import Engine
from vllm_overlay.image.standin import (
    CONTAINERFILE,
    REQUIREMENTS,
    Inputs,
    StandinError,
    assemble_context,
    build_standin,
    standin_tag,
    wheel_specs,
)
from vllm_overlay.series.pin import PIN_FILE, Pin, load_pin

SHA = "0" * 64


def noxenv_constant(name: str) -> object:
    """A constant of ci/noxenv.py (the CPU environment the sessions build),
    read from its source: nox is not installed here."""
    tree = ast.parse((REPO / "ci" / "noxenv.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"ci/noxenv.py has no {name}")


def test_the_standin_installs_what_the_cpu_environment_installs() -> None:
    assert noxenv_constant("TORCH") == standin.TORCH
    assert noxenv_constant("NO_DEPS") == standin.NO_DEPS
    specs = wheel_specs(REPO)
    reqs = (REPO / REQUIREMENTS).read_text()
    assert "numpy==" in reqs and next(s for s in specs if s.startswith("numpy=="))
    assert specs[:3] == [standin.PIP, standin.SETUPTOOLS, standin.TORCH]


def copy_inputs(dest: Path) -> Path:
    for rel in (CONTAINERFILE, REQUIREMENTS, PIN_FILE):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    return dest


def test_the_tag_names_every_input(tmp_path: Path, pin: Pin) -> None:
    repo = copy_inputs(tmp_path)
    tag = standin_tag(repo, pin, SHA)
    assert tag.startswith(f"localhost/vllm-moriio-overlay-standin:v{pin.vllm.version}-")
    assert standin_tag(repo, pin, SHA) == tag  # stable
    assert standin_tag(repo, pin, "1" * 64) != tag  # another wheel
    containerfile = repo / CONTAINERFILE
    containerfile.write_text(containerfile.read_text() + "# changed\n")
    changed = standin_tag(repo, pin, SHA)
    assert changed != tag
    reqs = repo / REQUIREMENTS
    reqs.write_text(reqs.read_text() + "six==1.16.0\n")
    assert standin_tag(repo, pin, SHA) not in (tag, changed)


def test_a_wheel_that_is_not_the_pins_is_refused_first(
    tmp_path: Path, pin: Pin
) -> None:
    wheel = tmp_path / pin.vllm.wheel
    wheel.write_bytes(b"not the wheel")
    never = Engine("buildah", str(tmp_path / "no-such-engine"))
    with pytest.raises(StandinError, match="is not the pinned"):
        build_standin(REPO, load_pin(REPO / PIN_FILE), wheel, never, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_the_context_links_its_inputs(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(b"tar")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "a-1-py3-none-any.whl").write_bytes(b"a")
    (wheels / ".complete").write_text("")
    extra = tmp_path / "req.txt"
    extra.write_text("a==1\n")
    context = tmp_path / "context"
    assemble_context(
        context, REPO / CONTAINERFILE, Inputs(rootfs, wheels), {"r.txt": extra}
    )
    assert sorted(p.name for p in context.iterdir()) == [
        "Containerfile",
        "r.txt",
        "rootfs.tar",
        "wheels",
    ]
    assert (context / "rootfs.tar").stat().st_ino == rootfs.stat().st_ino
    assert [p.name for p in (context / "wheels").iterdir()] == ["a-1-py3-none-any.whl"]
