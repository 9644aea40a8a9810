"""The simulator's fast paths give what their one-at-a-time references give.

``prompt_tokens`` builds each case's tokens in int64 arrays; its reference
(``prompt_tokens_reference``) builds them one token at a time. The tokens
must be the same ints, and a sample of whole cases through the real
schedulers must give the same results either way.
"""

from __future__ import annotations

import pytest

from vllm_overlay.simulate import drive

ARGS = [
    (1, 0),
    (1, 1),
    (2, 17),
    (7, 4096),
    (70_000, 4097),
    (3, 10, 0),
    (3, 10, 9),
    (3, 10, 10),
    (3, 10, 9, 2),
    (12, 300, 150, 5),
    (12, 300, -1, 5),
    (65_535, 4160, 4096, 0),
]


@pytest.mark.parametrize("args", ARGS)
def test_prompt_tokens_equal_the_reference(args):
    fast = drive.prompt_tokens(*args)
    assert fast == drive.prompt_tokens_reference(*args)
    assert all(type(t) is int for t in fast)


def _cases(pair, lengths, hits):
    return [pair.run_case(n, hit) for hit in hits for n in lengths]


@pytest.mark.parametrize(
    ("layout", "lengths"),
    [("llama", [1, 2, 15, 16, 17, 100, 255, 257]), ("gemma", [1, 33, 129, 300])],
)
def test_cases_equal_with_the_reference_tokens(layout, lengths, monkeypatch):
    from vllm_overlay.simulate.layouts import expand

    hits = [0.0, 0.5, 0.897, 1.0]
    spec = expand([layout])[0]
    fast = _cases(drive.Pair(spec, max(lengths) + 64, port=47200), lengths, hits)
    monkeypatch.setattr(drive, "prompt_tokens", drive.prompt_tokens_reference)
    slow = _cases(drive.Pair(spec, max(lengths) + 64, port=47400), lengths, hits)
    assert fast == slow
    assert all(r.error is None for r in fast)


def _refuse(local, remote, tables):
    """A READ the workers refuse: one more local list than remote ones."""
    del tables
    return [*local, []], remote


_SEQUENCE = [
    (100, 0.0, None),
    (200, 0.5, _refuse),
    (100, 0.5, None),
    (300, 0.897, None),
    (57, 1.0, _refuse),
    (58, 1.0, _refuse),
    (257, 0.0, None),
]


def _idle(leg) -> bool:
    pool = leg.scheduler.kv_cache_manager.block_pool
    return not leg.scheduler.requests and (
        pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    )


def test_a_refused_read_gives_what_a_rebuild_gives():
    from vllm_overlay.simulate.layouts import expand

    spec = expand(["llama"])[0]
    results = {}
    for recover, port in ((True, 47600), (False, 47800)):
        pair = drive.Pair(spec, 400, port=port, recover=recover)
        results[recover] = [pair.run_case(*case) for case in _SEQUENCE]
        assert _idle(pair.p) and _idle(pair.d)
    assert results[True] == results[False]
    errors = [r.error for r in results[True]]
    assert [e is not None for e in errors] == [c[2] is _refuse for c in _SEQUENCE]
    assert all(e.startswith("RuntimeError: ReqMeta group count") for e in errors if e)
    assert not any(r.wrong for r in results[True])


def test_cases_equal_with_vllms_hasher_alone(monkeypatch):
    from vllm_overlay.simulate.hashes import PromptHashes
    from vllm_overlay.simulate.layouts import expand

    lengths, hits = [1, 16, 17, 100, 257, 1000], [0.0, 0.5, 0.897, 1.0]
    spec = expand(["dsv4"])[0]
    fast = _cases(drive.Pair(spec, 1100, port=47900), lengths, hits)
    monkeypatch.setattr(PromptHashes, "wrap", lambda self, hasher, leg: hasher)
    slow = _cases(drive.Pair(spec, 1100, port=47950), lengths, hits)
    assert fast == slow
    assert all(r.error is None for r in fast)
