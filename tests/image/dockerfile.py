"""docker/Dockerfile as its instructions, for the image tests."""

from __future__ import annotations

from tests.repo import REPO

DOCKERFILE = REPO / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """Each instruction (its word upper-cased) and the rest of its line,
    continuation lines joined, comments left out."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out
