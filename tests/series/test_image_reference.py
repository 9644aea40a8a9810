"""Image references as docker, podman and buildah read them: a registry with
a port, short names qualified with docker.io, pinning by digest."""

from __future__ import annotations

import pytest

from vllm_overlay.series.imageref import (
    ImageReference,
    ImageReferenceError,
    parse_reference,
    qualify,
)
from vllm_overlay.series.pin import ImageRef, PinError, decode_pin

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "registry", "path", "tag", "digest"),
    [
        ("vllm/vllm-openai-rocm:v0.33.0", "", "vllm/vllm-openai-rocm", "v0.33.0", ""),
        ("ubuntu", "", "ubuntu", "", ""),
        ("reg:5000/x:tag", "reg:5000", "x", "tag", ""),
        ("reg:5000/x", "reg:5000", "x", "", ""),
        ("reg:5000/team/x:1.0", "reg:5000", "team/x", "1.0", ""),
        ("localhost/x:1", "localhost", "x", "1", ""),
        ("localhost:5000/a/b", "localhost:5000", "a/b", "", ""),
        ("ghcr.io/o/i:t@" + DIGEST, "ghcr.io", "o/i", "t", DIGEST),
        ("reg:5000/x@" + DIGEST, "reg:5000", "x", "", DIGEST),
    ],
)
def test_parse(text: str, registry: str, path: str, tag: str, digest: str) -> None:
    ref = parse_reference(text)
    assert ref == ImageReference(registry, path, tag, digest)
    assert str(ref) == text


@pytest.mark.parametrize(
    ("text", "qualified"),
    [
        ("vllm/vllm-openai-rocm:v0.33.0", "docker.io/vllm/vllm-openai-rocm:v0.33.0"),
        ("ubuntu:22.04", "docker.io/library/ubuntu:22.04"),
        ("docker.io/vllm/x:1", "docker.io/vllm/x:1"),
        ("reg:5000/x:tag", "reg:5000/x:tag"),
        ("localhost/x", "localhost/x"),
    ],
)
def test_short_names_are_qualified_with_docker_io(text: str, qualified: str) -> None:
    assert qualify(text) == qualified


def test_by_digest_keeps_the_registry_port() -> None:
    ref = parse_reference("reg:5000/x:tag").with_digest(DIGEST)
    assert ref.by_digest() == f"reg:5000/x@{DIGEST}"
    assert str(ref) == f"reg:5000/x:tag@{DIGEST}"


@pytest.mark.parametrize(
    "text",
    ["", "Vllm/x", "x//y", "x:", "reg:5000/x:bad tag", "x@sha256:123", "reg:port/x"],
)
def test_not_a_reference(text: str) -> None:
    with pytest.raises(ImageReferenceError):
        parse_reference(text)


def test_pin_pull_ref_by_digest_with_a_registry_port() -> None:
    # The old helper cut at the first ':' and built `reg@sha256:...`.
    image = ImageRef("reg:5000/team/vllm-openai-rocm:v0.33.0", DIGEST)
    assert image.pull_ref == f"reg:5000/team/vllm-openai-rocm@{DIGEST}"
    assert ImageRef("vllm/vllm-openai-rocm:v0.33.0").pull_ref == (
        "docker.io/vllm/vllm-openai-rocm:v0.33.0"
    )


def test_pin_refuses_a_malformed_reference(pin_text: str) -> None:
    reference = decode_pin(pin_text).image.reference
    bad = pin_text.replace(
        f'reference = "{reference}"',
        f'reference = "{reference.replace("/vllm/", "//")}"',
    )
    assert bad != pin_text
    with pytest.raises(PinError, match="not an image path"):
        decode_pin(bad)


def test_the_pinned_base_is_fully_qualified(pin_text: str) -> None:
    # buildah and podman refuse a short name unless registries.conf says
    # which registry to search.
    image = decode_pin(pin_text).image
    assert parse_reference(image.reference).registry == "docker.io"
