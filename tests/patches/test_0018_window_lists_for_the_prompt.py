"""The READ prefiller lays out its window lists for the whole prompt
(``moriio_protocol`` 2).

A READ prefiller computes N - 1 tokens when the model has a window group; its
window lists used to end with the page of position N - 2. A decoder pairs a
window list by its tail against its own table of N tokens: vLLM's own MoRIIO
decoder, and an overlaid decoder behind vLLM's MoRIIO toy proxy (which
forwards only ``remote_engine_id``, ``remote_block_ids`` and ``transfer_id``
and sets ``do_remote_prefill`` itself), paired them one page off when
N = 1 mod B. The lists now end with the page of position N - 1, padded with
the prefiller's last block.

A real prefill scheduler and a real decode scheduler run two prompts, the
decoder admitting both in one step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

from tests.patches.builders import (
    SchedulerPair,
    build_scheduler_pair,
    full_attention_spec,
    prompt,
    sliding_window_spec,
)

REPO = Path(__file__).resolve().parents[2]
B, W = 16, 64
# What vLLM's MoRIIO toy proxy copies from the prefiller's kv_transfer_params
# into the decoder's; the prefiller's address stands for the one it encodes
# in the request id.
TOY_PROXY_FIELDS = (
    "remote_engine_id",
    "remote_block_ids",
    "transfer_id",
    "remote_host",
    "remote_handshake_port",
    "remote_notify_port",
)


@pytest.fixture(scope="module")
def gemma_pair(llama_model_dir: Path) -> SchedulerPair:
    groups = [
        (["model.layers.0.self_attn.attn"], full_attention_spec(B)),
        (["model.layers.1.self_attn.attn"], sliding_window_spec(B, W)),
    ]
    return build_scheduler_pair(llama_model_dir, groups, B)


def _toy_proxy(params: dict[str, Any]) -> dict[str, Any]:
    out = {k: params[k] for k in TOY_PROXY_FIELDS if k in params}
    out.update(do_remote_prefill=True, do_remote_decode=False)
    return out


@pytest.mark.parametrize("n", range(W + 1, W + 1 + 2 * B))
def test_decoder_without_the_statement_pairs_by_position(
    gemma_pair: SchedulerPair, n: int
) -> None:
    """Behind the toy proxy the decoder sees no statement and pairs the lists
    as laid out for N tokens: each window page it needs is READ from the
    prefiller's page of the same positions, beside a second request whose
    payload is complete, and neither is prefilled locally."""
    pair = gemma_pair
    i = next(pair.counter)
    rids = {"toy": f"toy-{i}", "full": f"full-{i}"}
    tokens = {k: prompt(2 * i + j + 1, n) for j, k in enumerate(rids)}
    prefilled = {k: pair.prefill_run(rids[k], tokens[k]) for k in rids}
    params = {
        "toy": _toy_proxy(prefilled["toy"][0]),
        "full": {**prefilled["full"][0], "do_remote_prefill": True},
    }
    for k in rids:
        pair.decode.add_request(pair._request(rids[k], tokens[k], params[k]))
    output = pair.decode.schedule()
    # Neither is prefilled locally (an asynchronous load is not computed yet).
    assert all(output.num_scheduled_tokens.get(rid, 1) == 1 for rid in rids.values())
    for k, rid in rids.items():
        meta = output.kv_connector_metadata.reqs_to_recv[rid]
        d_tables = pair.decode.kv_cache_manager.get_block_ids(rid)
        p_tables = prefilled[k][1]
        first = max(n - W, 0) // B
        read = {}
        for d_block, p_block in zip(
            meta.local_block_ids[1], meta.remote_block_ids[1], strict=True
        ):
            assert 0 not in (d_block, p_block), (k, d_block, p_block)
            read[d_tables[1].index(d_block)] = p_block
        for page in range(first, -(-(n - 1) // B)):
            assert read.get(page) == p_tables[1][page], (k, page, read)
    pair._finish_step(pair.decode, output)
    while set(rids.values()) & set(pair.decode.requests):
        pair._step(pair.decode)
    pair._step(pair.prefill, finished_sending=set(rids.values()))


def test_window_lists_end_with_the_prompts_last_page(
    gemma_pair: SchedulerPair,
) -> None:
    """N = 1 mod B: the window list ends with one of the request's own blocks
    at the page of position N - 1, the full-attention list with N - 1's."""
    pair = gemma_pair
    i = next(pair.counter)
    n = 5 * B + 1
    params, tables, _ = pair.prefill_run(f"layout-{i}", prompt(i + 1, n))
    assert params["moriio_protocol"] == moriio_connector.MORIIO_PROTOCOL_VERSION
    assert params["prefilled_tokens"] == n - 1
    full, window = params["remote_block_ids"]
    assert full == tables[0][: (n - 1) // B]
    assert window[:-1] == tables[1][(n - 1) // B - len(window) + 1 : (n - 1) // B]
    assert window[-1] == tables[1][(n - 1) // B - 1] != 0
    pair._step(pair.prefill, finished_sending={f"layout-{i}"})
