"""The record `apply` leaves next to the overlaid module."""

from __future__ import annotations

from pathlib import Path

import msgspec

from vllm_overlay.safefile import (
    MAX_READ_BYTES,
    NotRegularError,
    TooLargeError,
    describe_stat,
    read_regular,
)

MANIFEST_NAME = ".overlay-manifest.json"


class ManifestFile(msgspec.Struct, forbid_unknown_fields=True):
    base_sha256: str
    overlaid_sha256: str


class AppliedPatch(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    text: str  # the exact patch applied, so it can be peeled off later


class Manifest(msgspec.Struct, forbid_unknown_fields=True):
    tool_version: str
    series_id: str
    vllm_version: str
    vllm_git_commit: str
    patches: list[AppliedPatch]
    files: dict[str, ManifestFile]

    @property
    def patch_names(self) -> list[str]:
        return [p.name for p in self.patches]


def manifest_path(root: Path, module: str) -> Path:
    return root / module / MANIFEST_NAME


def load_manifest(path: Path) -> tuple[Manifest | None, str]:
    """The manifest at ``path`` and "", or None and why it cannot be used
    ("" when there is none)."""
    try:
        data = read_regular(path, MAX_READ_BYTES, "a manifest")
    except FileNotFoundError:
        return None, ""
    except NotRegularError as e:
        return None, f"{describe_stat(path, e.st)} stands at its path"
    except TooLargeError as e:
        return None, e.why
    except OSError as e:
        return None, f"cannot read it: {e.strerror}"
    try:
        return msgspec.json.decode(data, type=Manifest), ""
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return None, f"not a manifest ({e})"


def read_manifest(path: Path) -> Manifest | None:
    """The manifest at ``path``; None when absent or unusable."""
    return load_manifest(path)[0]


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n"
