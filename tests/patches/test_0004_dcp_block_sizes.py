"""Patch 0004: per-group block sizes are DCP-effective: a DCP-sharded spec's
block holds block_size * DCP positions, so the WRITE prompt clamp counts
blocks by that span.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.patches.builders import (
    Layout,
    allocation,
    cdiv,
    full_attention_spec,
    make_kv_cache_blocks,
    make_leg_connector,
    make_request,
    make_scheduler_output,
    prefill_id,
)


@pytest.mark.parametrize("dcp", [1, 2], ids=["dcp1", "dcp2"])
def test_write_save_clamps_to_prompt_blocks(llama_model_dir: Path, dcp: int) -> None:
    """WRITE producer (full attention): the blocks it pushes are the prompt's
    blocks only, without its 8 lookahead slots, whose blocks the consumer
    never allocated."""
    layout = Layout(block_size=16, window=None, dcp=dcp)
    producer = make_leg_connector(
        llama_model_dir,
        "kv_producer",
        [(["model.layers.0.self_attn.attn"], full_attention_spec(16))],
        read_mode=False,
        dcp=dcp,
    )
    params = {
        "do_remote_decode": True,
        "remote_block_ids": [],
        "remote_engine_id": "decode",
        "remote_host": "127.0.0.1",
        "remote_handshake_port": 1,
        "remote_notify_port": 2,
    }
    wrong: list[str] = []
    for n in range(1, 4 * layout.spans[0] + 1):
        request = make_request(f"w-{n}", n, {**params, "transfer_id": f"w-{n}"})
        table = allocation(layout, n + 8, prefill_id)
        producer.update_state_after_alloc(request, make_kv_cache_blocks(table), 0)
        output = make_scheduler_output()
        output.num_scheduled_tokens = {request.request_id: n}
        meta = producer.build_connector_meta(output)
        saved = meta.reqs_to_save[request.request_id].local_block_ids
        # Every block of positions [0, N - 1), which the decoder needs, at most
        # the prompt's (the decoder computes position N - 1 itself, so a
        # producer may leave out a block that holds nothing else).
        least, most = cdiv(n - 1, layout.spans[0]), cdiv(n, layout.spans[0])
        if not (
            least <= len(saved[0]) <= most
            and list(saved[0]) == table[0][: len(saved[0])]
        ):
            wrong.append(
                f"N={n}: saved {len(saved[0])} blocks, expected {least} to {most}"
            )
    assert not wrong, f"{len(wrong)} wrong: {wrong[:4]}"
