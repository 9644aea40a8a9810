"""Secret values of a run: which env names hold one, and text with them
masked. A secret reaches a container by name only (never on a command
line); plans, logs and reports show it as ``***``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from vllm_overlay.errors import OverlayError

MASK = "***"
# Parts of an env name that mark its value secret: HF_TOKEN,
# HUGGING_FACE_HUB_TOKEN, VLLM_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD ...
SECRET_PARTS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
# Shorter values are not scrubbed from logs: they would mask unrelated text.
SCRUB_MIN = 4


class SecretError(OverlayError):
    """A secret the run needs has no value."""


def is_secret(name: str) -> bool:
    """Whether the env variable ``name`` holds a secret."""
    upper = name.upper()
    return any(part in upper for part in SECRET_PARTS)


def secret_names(env: Mapping[str, str]) -> list[str]:
    return sorted(k for k in env if is_secret(k))


def masked_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with every secret value shown as ``***``."""
    return {k: MASK if is_secret(k) else v for k, v in env.items()}


def scrub(text: str, values: Iterable[str]) -> str:
    """``text`` with every occurrence of a secret value replaced by ``***``."""
    for value in sorted(set(values), key=len, reverse=True):
        if len(value) >= SCRUB_MIN:
            text = text.replace(value, MASK)
    return text


def all_values(secrets: Mapping[str, Mapping[str, str]]) -> set[str]:
    """Every value of a {container: {name: value}} map."""
    return {v for env in secrets.values() for v in env.values()}


def masking(say: Callable[[str], None], values: Iterable[str]) -> Callable[[str], None]:
    """``say`` with every secret value of its lines shown as ``***``."""
    hidden = set(values)

    def masked(line: str) -> None:
        say(scrub(line, hidden))

    return masked
