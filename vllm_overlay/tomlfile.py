"""TOML files decoded into a typed ``msgspec.Struct``, with one clear error."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

from vllm_overlay.errors import OverlayError

T = TypeVar("T")


def decode_toml(
    data: bytes | str, type_: type[T], source: str, what: str, error: type[OverlayError]
) -> T:
    """Decode ``data`` as a ``type_``; a bad file raises ``error`` naming
    ``source`` and the offending field."""
    try:
        return msgspec.toml.decode(data, type=type_)
    except msgspec.ValidationError as e:
        raise error(f"{source}: invalid {what}: {e}") from None
    except msgspec.DecodeError as e:
        raise error(f"{source}: not valid TOML: {e}") from None


def read_toml(path: Path, type_: type[T], what: str, error: type[OverlayError]) -> T:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror}") from None
    return decode_toml(data, type_, str(path), what, error)
