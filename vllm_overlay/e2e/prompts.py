"""Prompts built to exact token lengths with the model's own tokenizer.

Prompts are sent as token ids, so a prompt of length N is exactly N tokens on
the server. Key-value lookup prompts exercise the prompt-length sweep; the
needle-in-a-haystack prompts exercise long transfers.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from vllm_overlay.e2e.config import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

HEADER = "Below is a list of keys and their values. Remember them.\n"
FILLER_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)


class Prompt(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    kind: Literal["kv", "plain", "needle", "prefix", "probe", "math"]
    token_ids: list[int]
    expected: str = ""  # the answer a correct model gives (kv, needle)
    words: int = 0  # haystack words (needle)

    @property
    def length(self) -> int:
        return len(self.token_ids)


def load_tokenizer(path: Path | str) -> Tokenizer:
    """The model's tokenizer.json; one clear error when it cannot be used."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            "the E2E checks need `tokenizers`: pip install 'vllm-moriio-overlay[e2e]'"
        ) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise ConfigError(f"model.tokenizer {path}: cannot load: {e}") from None


def special_prefix(tok: Tokenizer) -> list[int]:
    """What the tokenizer prepends to a prompt (e.g. BOS), as ids."""
    return list(tok.encode("", add_special_tokens=True).ids)


def encode(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def kv_prompt(tok: Tokenizer, length: int, seed: int = 0) -> Prompt:
    """A key-value lookup prompt of exactly ``length`` tokens.

    The asked pair plus as many other pairs as fit, in random order; newline
    tokens pad to the exact length. Lengths too short for one pair and the
    question get a plain counting prompt of the same length.
    """
    rng = random.Random(f"{seed}:{length}")
    prefix = special_prefix(tok) + encode(tok, HEADER)
    pad = encode(tok, "\n")[-1:]

    def pair() -> tuple[str, str, list[int]]:
        key, value = f"{rng.randrange(10**4):04d}", f"{rng.randrange(10**6):06d}"
        return key, value, encode(tok, f"key {key}: value {value}\n")

    target_key, target_value, target_line = pair()
    question = encode(tok, f"\nWhat is the value of key {target_key}? The value is")
    budget = length - len(prefix) - len(question)
    if len(target_line) > budget:
        return plain_prompt(tok, length)
    lines = [target_line]
    used = len(target_line)
    seen = {target_key}
    while True:
        key, _, line = pair()
        if key in seen:
            continue
        if used + len(line) > budget:
            break
        lines.append(line)
        used += len(line)
        seen.add(key)
    rng.shuffle(lines)
    body = [t for line in lines for t in line]
    ids = prefix + body + pad * (budget - used) + question
    return Prompt(f"kv-{length}", "kv", ids, expected=target_value)


def plain_prompt(tok: Tokenizer, length: int) -> Prompt:
    text = " ".join(str(i) for i in range(1, 4 * length + 2))
    ids = (special_prefix(tok) + encode(tok, text))[:length]
    if len(ids) < length:
        raise ValueError(f"cannot build a {length}-token prompt with this tokenizer")
    return Prompt(f"plain-{length}", "plain", ids)


def haystack(words: int) -> list[str]:
    out: list[str] = []
    i = 0
    while len(out) < words:
        out.extend(FILLER_SENTENCES[i % len(FILLER_SENTENCES)].split())
        i += 1
    return out[:words]


def needle_prompt(
    tok: Tokenizer, words: int, seed: int = 0, depth: float = 0.5
) -> Prompt:
    """A haystack of exactly ``words`` filler words with one needle sentence
    at ``depth``, then the question."""
    rng = random.Random(f"needle:{seed}:{words}")
    number = f"{rng.randrange(10**7):07d}"
    hay = haystack(words)
    at = int(len(hay) * depth)
    needle = f"The special magic number is {number}."
    text = " ".join([*hay[:at], needle, *hay[at:]])
    question = "\nWhat is the special magic number in the text above? It is"
    ids = special_prefix(tok) + encode(tok, text + question)
    return Prompt(f"needle-{words}", "needle", ids, expected=number, words=words)


def sweep_prompts(
    tok: Tokenizer, lengths: Iterable[int], seed: int = 0
) -> list[Prompt]:
    return [kv_prompt(tok, n, seed) for n in lengths]


def prefix_pair(
    tok: Tokenizer, length: int, fraction: float, seed: int = 0
) -> tuple[Prompt, Prompt]:
    """Two prompts of ``length`` tokens; the second repeats the first one's
    first ``fraction`` of tokens, then goes on differently (and ends with
    another question). Sent in order through P/D, the second finds that
    prefix in the decoder's cache and loads only the rest."""
    first = kv_prompt(tok, length, seed + 11)
    other = kv_prompt(tok, length, seed + 12)
    shared = int(length * fraction)
    ids = first.token_ids[:shared] + other.token_ids[shared:]
    tag = f"{round(fraction * 100, 1):g}"
    return (
        Prompt(f"prefix-{tag}-first", "prefix", first.token_ids, first.expected),
        Prompt(f"prefix-{tag}-second", "prefix", ids),
    )


def probe_prompt(tok: Tokenizer) -> Prompt:
    """A short prompt for the front end's readiness and max_tokens probe."""
    return Prompt("probe", "probe", special_prefix(tok) + encode(tok, HEADER))
