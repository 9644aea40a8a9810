"""``PromptHashes`` gives every request the block hashes vLLM's own hasher
gives it, whatever it reuses from the prompts hashed before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_overlay.simulate.drive import prompt_tokens
from vllm_overlay.simulate.hashes import PromptHashes, common_prefix


def _leg(block: int, lookahead: int) -> SimpleNamespace:
    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            num_hash_lookahead_tokens=lookahead,
            cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256"),
        ),
        kv_cache_config=SimpleNamespace(hash_block_size=block),
    )


def _hasher(block: int, lookahead: int):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(block, fn, lookahead)


def _request(rid, tokens, hasher, **kwargs):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(rid, list(tokens), params, None, block_hasher=hasher, **kwargs)


def _case_prompts(uid: int, n: int, hit: float) -> list[list[int]]:
    """What one case hashes: the prompt (prefill), the warm-up, the prompt
    again (decoder)."""
    shared = round(n * hit)
    warm = [prompt_tokens(uid, shared + 1, shared=shared)] if shared else []
    return [prompt_tokens(uid, n), *warm, prompt_tokens(uid, n)]


@pytest.mark.parametrize(("block", "lookahead"), [(16, 0), (64, 0), (16, 3)])
def test_every_request_gets_vllms_hashes(block: int, lookahead: int) -> None:
    real = _hasher(block, lookahead)
    legs = [_leg(block, lookahead), _leg(block, lookahead)]
    memo = PromptHashes()
    p, d = (memo.wrap(real, leg) for leg in legs)
    count = 0
    for uid, (n, hit) in enumerate(
        [
            (1, 0.0),
            (15, 1.0),
            (16, 1.0),
            (17, 0.5),
            (300, 0.897),
            (1000, 0.5),
            (1000, 1.0),
            (999, 0.0),
            (4096, 0.897),
            # the warm-up leaves the prompt 1 and 2 tokens past a block's end
            (100, 0.33),
            (1000, 0.514),
        ]  # fmt: skip
    ):
        prompts = _case_prompts(uid + 1, n, hit)
        for i, tokens in enumerate(prompts):
            hasher = p if i == 0 else d
            got = _request(f"r{uid}-{i}", tokens, hasher)
            want = _request(f"r{uid}-{i}", tokens, real)
            assert got.block_hashes == want.block_hashes, (n, hit, i)
            count += len(want.block_hashes)
            # Decode steps hash the blocks the output completes.
            for t in range(block + lookahead):
                got.append_output_token_ids(t + 7)
                want.append_output_token_ids(t + 7)
            assert got.block_hashes == want.block_hashes, (n, hit, i, "decode")
    assert count > 0


def test_salted_requests_are_hashed_by_vllm_alone() -> None:
    real = _hasher(16, 0)
    memo = PromptHashes()
    hasher = memo.wrap(real, _leg(16, 0))
    tokens = prompt_tokens(1, 100)
    plain = _request("a", tokens, hasher)
    salted = _request("b", tokens, hasher, cache_salt="s")
    assert (
        salted.block_hashes == _request("c", tokens, real, cache_salt="s").block_hashes
    )
    assert salted.block_hashes[0] != plain.block_hashes[0]


def test_settings_are_kept_apart() -> None:
    memo = PromptHashes()
    tokens = prompt_tokens(1, 200)
    small, large = _hasher(16, 0), _hasher(32, 0)
    _request("a", tokens, memo.wrap(small, _leg(16, 0)))
    got = _request("b", tokens, memo.wrap(large, _leg(32, 0)))
    assert got.block_hashes == _request("c", tokens, large).block_hashes


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [
        ([], [], 0),
        ([1], [2], 0),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2, 3], [1, 2, 4], 2),
        (list(range(1000)), [*range(999), -1], 999),
    ],  # fmt: skip
)
def test_common_prefix(a: list[int], b: list[int], want: int) -> None:
    assert common_prefix(a, b) == want == common_prefix(b, a)
