"""Block hashes of a prompt computed once per case, not once per request.

A case hashes the same tokens up to three times: the prefill's request, the
decoder's warm-up (a prefix of the prompt) and the decoder's request. vLLM's
request block hasher chains each block's hash over every token up to the
block's end (and the lookahead tokens after it), so a request whose tokens
agree with an earlier prompt's up to there has that prompt's hash for the
block. ``PromptHashes`` hands those over and lets vLLM's hasher compute the
rest, from the last one reused; the values are vLLM's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Hasher = Callable[[Any], list[Any]]

_KEEP = 2
"""Prompts remembered per hash setting: the prompt and the warm-up."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    m = min(len(a), len(b))
    if a[:m] == b[:m]:
        return m
    lo, hi = 0, m  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PromptHashes:
    """The last prompts hashed under each setting (block size, lookahead,
    hash function) and their block hashes; one per pair of legs, dropped
    when the legs are rebuilt."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, ...], list[tuple[list[int], list[Any]]]] = {}

    def wrap(self, hasher: Hasher, leg: Any) -> Hasher:
        """``hasher`` (vLLM's, made for ``leg``) reusing what this object saw."""
        cfg = leg.vllm_config
        block = int(leg.kv_cache_config.hash_block_size)
        lookahead = int(cfg.num_hash_lookahead_tokens)
        key = (block, lookahead, cfg.cache_config.prefix_caching_hash_algo)
        seen = self._seen.setdefault(key, [])

        def reusing(request: Any) -> list[Any]:
            if request.block_hashes or not _tokens_only(request):
                return hasher(request)
            tokens = list(request.all_token_ids)
            emitted = max(0, (len(tokens) - lookahead) // block)
            best: list[Any] = []
            for old_tokens, old_hashes in seen:
                agree = common_prefix(tokens, old_tokens)
                k = min(len(old_hashes), emitted, max(0, agree - lookahead) // block)
                if k > len(best):
                    best = old_hashes[:k]
            if best:
                own = request.block_hashes
                request.block_hashes = list(best)
                try:
                    rest = hasher(request)
                finally:
                    request.block_hashes = own
                hashes = best + rest
            else:
                hashes = hasher(request)
            seen.insert(0, (tokens, hashes))
            del seen[_KEEP:]
            return hashes

        return reusing


def _tokens_only(request: Any) -> bool:
    """Do the request's block hashes depend on its tokens alone (no images,
    LoRA, cache salt or prompt embeddings in the extra keys)?"""
    return not (
        request.mm_features
        or request.lora_request
        or request.cache_salt
        or request.prompt_embeds is not None
    )
