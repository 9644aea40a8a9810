"""The record `apply` leaves next to the overlaid module."""

from __future__ import annotations

from pathlib import Path

import msgspec

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


def read_manifest(path: Path) -> Manifest | None:
    """The manifest at ``path``; None when absent or unreadable (status then
    relies on hashes alone and says so)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n"
