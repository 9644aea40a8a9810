"""The pin: which vLLM build the series is made for, down to each file's hash."""

from __future__ import annotations

import hashlib
import os
import posixpath
from pathlib import Path
from typing import Annotated

import msgspec
import tomli_w

from vllm_overlay.errors import OverlayError
from vllm_overlay.series.imageref import ImageReferenceError, parse_reference
from vllm_overlay.tomlfile import decode_toml, read_toml

PIN_FILE = "pin.toml"
# The MoRIIO package, relative to the directory holding `vllm`: the one place
# its path is spelled; pin.toml's `module` must say the same.
MODULE_DIR = "vllm/distributed/kv_transfer/kv_connector/v1/moriio"
MODULE_PACKAGE = MODULE_DIR.replace("/", ".")

Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class PinError(OverlayError):
    """The pin file is missing, malformed or incomplete."""


class VllmBase(msgspec.Struct, forbid_unknown_fields=True):
    version: Annotated[str, msgspec.Meta(pattern=r"^\d+\.\d+\.\d+\S*$")]
    git_commit: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{7,40}$")]
    wheel: Annotated[str, msgspec.Meta(pattern=r"^vllm-.+\.whl$")]
    wheel_sha256: Sha256


class ImageRef(msgspec.Struct, forbid_unknown_fields=True):
    # Fully qualified (`docker.io/...`): buildah and podman do not guess a
    # registry for a short name.
    reference: Annotated[str, msgspec.Meta(pattern=r"^[\w.\-/:]+$")]
    # The manifest digest of `reference` when known; builds then use it.
    digest: Annotated[str, msgspec.Meta(pattern=r"^(sha256:[0-9a-f]{64})?$")] = ""

    def __post_init__(self) -> None:
        try:
            parse_reference(self.reference)
        except ImageReferenceError as e:
            raise ValueError(str(e)) from None

    @property
    def pull_ref(self) -> str:
        """The reference to build from: `name@digest` when the pin has a
        digest (a registry port stays: `reg:5000/x@sha256:...`)."""
        ref = parse_reference(self.reference).qualified()
        return ref.with_digest(self.digest).by_digest() if self.digest else str(ref)


class Pin(msgspec.Struct, forbid_unknown_fields=True):
    vllm: VllmBase
    image: ImageRef
    module: NonEmpty
    # Path (relative to the directory holding the `vllm` package) -> sha256.
    files: dict[str, Sha256]
    # The vLLM core files the upstream-only core series (patches/core/)
    # changes, by the same key; never applied to an install.
    core_files: dict[str, Sha256] = {}

    def __post_init__(self) -> None:
        if self.module.rstrip("/") != MODULE_DIR:
            raise ValueError(f"`module` must be {MODULE_DIR!r}, not {self.module!r}")
        if not self.files:
            raise ValueError("`files` must name at least one file")
        prefix = self.module.rstrip("/") + "/"
        for path in self.files:
            if posixpath.normpath(path) != path or path.startswith("/"):
                raise ValueError(
                    f"`files`: {path!r} is not a normalised relative path "
                    f"(no '..', '.', '//' or leading '/')"
                )
            if not path.startswith(prefix):
                raise ValueError(f"`files`: {path!r} is outside module {self.module!r}")
        for path in self.core_files:
            if posixpath.normpath(path) != path or not path.startswith("vllm/"):
                raise ValueError(
                    f"`core_files`: {path!r} is not a normalised path below vllm/"
                )
            if path.startswith(prefix):
                raise ValueError(
                    f"`core_files`: {path!r} is in module {self.module!r} (`files`)"
                )


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def decode_pin(data: bytes | str, source: str = PIN_FILE) -> Pin:
    return decode_toml(data, Pin, source, "pin", PinError)


def load_pin(path: Path) -> Pin:
    return read_toml(path, Pin, "pin", PinError)


def encode_pin(pin: Pin) -> str:
    header = (
        "# The vLLM build the patch series is made for: every hash is checked\n"
        "# before anything is applied. `vllm-overlay rebase` rewrites this file.\n"
    )
    data = msgspec.to_builtins(pin)
    if not data["core_files"]:
        del data["core_files"]
    return header + tomli_w.dumps(data)


def module_files(module_dir: Path, module: str) -> dict[str, str]:
    """sha256 of every file below ``module_dir`` (the directory of
    ``module``), by its path ``module/...``, caches and overlay files aside.
    A symlink is not followed: its value is "". A name that is not UTF-8 is
    given with backslash escapes (it can only be shown, never pinned)."""
    out: dict[str, str] = {}
    for p in sorted(module_dir.rglob("*")):
        if "__pycache__" in p.parts or p.name.startswith("."):
            continue
        rel = f"{module.rstrip('/')}/{p.relative_to(module_dir).as_posix()}"
        rel = os.fsencode(rel).decode("utf-8", "backslashreplace")
        if p.is_symlink():
            out[rel] = ""
        elif p.is_file():
            out[rel] = sha256_file(p)
    return out
