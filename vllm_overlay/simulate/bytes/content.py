"""What a "model" writes into KV pages: a deterministic function of the
prompt prefix, the layer, the global head and the byte.

The KV of position ``p`` depends on the tokens ``[0, p]`` (their prefix hash
``h_p``), the layer, the KV head in global (TP-independent) numbering and the
byte within the head's content; a recurrent state after ``t`` tokens depends
on ``h_{t-1}``, the layer, the state region and the byte in global numbering.
Every byte of a page is therefore checkable on its own: a shifted offset, a
wrong head, a swapped layer or a stale page all show up as wrong bytes.

Pure numpy; works on the ``uint8`` numpy views of a rank's KV cache tensors.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

_MASK = (1 << 64) - 1
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_LAYER = 0xD6E8FEB86659FD93
_HEAD = 0xA0761D6478BD642F
_REGION = 0xE7037ED1A0B428DB
_STATE = 0x8EBC6AF09C88C6E3


def prefix_hashes(tokens: Sequence[int]) -> np.ndarray:
    """``h_p`` for every position: a hash of ``tokens[0..p]``."""
    out = np.empty(len(tokens), dtype=np.uint64)
    h = 0x243F6A8885A308D3
    for i, tok in enumerate(tokens):
        h = ((h ^ (int(tok) + 1)) * 0x100000001B3 + 0x632BE59BD9B4E019) & _MASK
        h ^= h >> 29
        out[i] = h
    return out


def layer_key(layer_name: str) -> int:
    return zlib.crc32(layer_name.encode()) * _LAYER & _MASK


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


_WORDS = np.empty(0, dtype=np.uint64)
"""``mix(w * G)`` for word ``w``, grown on demand: every row's words are its
tag XOR these, one vector operation per word instead of a mix per word."""


def _words(first: int, count: int) -> np.ndarray:
    global _WORDS
    end = first + count
    if end > _WORDS.size:
        size = max(end, 2 * _WORDS.size, 1024)
        with np.errstate(over="ignore"):
            _WORDS = _mix(np.arange(size, dtype=np.uint64) * _GOLDEN + _GOLDEN)
    return _WORDS[first:end]


def _bytes(tags: np.ndarray, first_word: int, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes per tag: 8-byte words ``tag ^ mix((w + word) * G)``,
    the last one cut short when ``nbytes`` is not a whole number of words
    (an fp8 indexer row of 128 + 4 scale bytes). Tags are already mixed, so
    rows of different tags differ in every word, and a row's words differ
    from each other: a shift by any number of bytes changes them."""
    nwords = -(-nbytes // 8)
    out = tags[..., None] ^ _words(first_word, nwords)
    return out.view(np.uint8).reshape(*tags.shape, nwords * 8)[..., :nbytes]


def global_heads(
    rank: int, tp_size: int, total_heads: int, local_heads: int
) -> list[int]:
    """vLLM's KV head sharding: ``tp <= heads`` splits them evenly, more ranks
    than heads replicate head ``rank * heads // tp`` (``moriio_tp_mapping``)."""
    if tp_size <= total_heads:
        per_rank = total_heads // tp_size
        assert per_rank == local_heads, (rank, tp_size, total_heads, local_heads)
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    assert local_heads == 1, (tp_size, total_heads, local_heads)
    return [rank * total_heads // tp_size]


def attention_bytes(
    hashes: np.ndarray,
    layer: int,
    heads: Sequence[int],
    nbytes: int,
    rows_first: bool = False,
) -> np.ndarray:
    """``[len(heads), len(hashes), nbytes]``: KV of each head at each
    position; ``rows_first``: ``[len(hashes), len(heads), nbytes]``, also
    contiguous."""
    head_keys = np.array([(h + 1) * _HEAD & _MASK for h in heads], dtype=np.uint64)
    with np.errstate(over="ignore"):
        tags = _mix(hashes[None, :] ^ np.uint64(layer) ^ head_keys[:, None])
    if rows_first:
        tags = np.ascontiguousarray(tags.T)
    return _bytes(tags, 0, nbytes)


def _mix_int(x: int) -> int:
    """``_mix`` of one word, on Python integers."""
    x ^= x >> 30
    x = x * 0xBF58476D1CE4E5B9 & _MASK
    x ^= x >> 27
    x = x * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def state_bytes(
    state_hash: int, layer: int, region: int, first_byte: int, nbytes: int
) -> np.ndarray:
    """A recurrent state region's bytes ``[first_byte, first_byte + nbytes)``
    in global numbering (the rank's shard starts at ``first_byte``)."""
    assert first_byte % 8 == 0
    key = int(state_hash) ^ int(layer) ^ ((region + 1) * _REGION & _MASK)
    tag = np.uint64(_mix_int(key ^ _STATE))
    words = _words(first_byte // 8, -(-nbytes // 8)) ^ tag
    return words.view(np.uint8)[:nbytes]


POISON = 0xA5
"""A state page whose input state was wrong gets this byte everywhere."""
