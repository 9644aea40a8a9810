"""Image references: `[registry[:port]/]path[:tag][@digest]`.

The parsing follows the grammar of the distribution reference (what docker,
podman and buildah accept): the first component is a registry only when it
holds a `.` or a `:` or is `localhost`; a tag is the text after the last `:`
of the last path component, so `reg:5000/x` has no tag and `reg:5000/x:1`
has tag `1`. Short names (`vllm/vllm-openai-rocm`) are qualified with
`docker.io`, as docker does: buildah and podman refuse to guess a registry
unless `registries.conf` tells them which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_overlay.errors import OverlayError

DEFAULT_REGISTRY = "docker.io"
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_REGISTRY = re.compile(r"^[A-Za-z0-9.-]+(?::[0-9]+)?$")


class ImageReferenceError(OverlayError):
    """Not an image reference."""


@dataclass(frozen=True)
class ImageReference:
    registry: str  # "" for a short name
    path: str  # "vllm/vllm-openai-rocm"
    tag: str = ""
    digest: str = ""

    @property
    def name(self) -> str:
        """`registry/path`, without tag or digest."""
        return f"{self.registry}/{self.path}" if self.registry else self.path

    def __str__(self) -> str:
        text = self.name
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text

    def qualified(self) -> ImageReference:
        """The same image with its registry spelled out (`docker.io/...`,
        `docker.io/library/...` for a one-component name)."""
        if self.registry:
            return self
        path = self.path if "/" in self.path else f"library/{self.path}"
        return ImageReference(DEFAULT_REGISTRY, path, self.tag, self.digest)

    def with_digest(self, digest: str) -> ImageReference:
        """Pinned by ``digest``; the tag stays for people (engines resolve
        `name:tag@digest` by the digest alone)."""
        if not DIGEST.match(digest):
            raise ImageReferenceError(f"{digest!r} is not a sha256 digest")
        return ImageReference(self.registry, self.path, self.tag, digest)

    def by_digest(self) -> str:
        """`name@digest`: the form every engine pulls and builds from."""
        if not self.digest:
            raise ImageReferenceError(f"{self} has no digest")
        return f"{self.name}@{self.digest}"


def parse_reference(text: str) -> ImageReference:
    """Split ``text`` into registry, path, tag and digest; a clear error when
    it is not a reference (an empty component, upper case in the path, a
    malformed tag or digest)."""
    rest, _, digest = text.partition("@")
    if digest and not DIGEST.match(digest):
        raise ImageReferenceError(f"{text!r}: digest {digest!r} is not sha256:<64 hex>")
    first, slash, remainder = rest.partition("/")
    registry = ""
    if slash and ("." in first or ":" in first or first == "localhost"):
        if not _REGISTRY.match(first):
            raise ImageReferenceError(
                f"{text!r}: {first!r} is not a registry host[:port]"
            )
        registry, rest = first, remainder
    path, tag = rest, ""
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, _, tag = path.rpartition(":")
        if not _TAG.match(tag):
            raise ImageReferenceError(f"{text!r}: {tag!r} is not a tag")
    components = path.split("/")
    if not all(_COMPONENT.match(c) for c in components):
        raise ImageReferenceError(
            f"{text!r}: {path!r} is not an image path (lower-case components "
            "separated by '/')"
        )
    return ImageReference(registry, path, tag, digest)


def qualify(text: str) -> str:
    """``text`` with its registry spelled out."""
    return str(parse_reference(text).qualified())
