"""Attention pages and bytes a hybrid MoRIIO READ moves per request, base
selection vs the overlay, on a Kimi-K3-like layout, at several decoder
prefix-hit ratios. A figure, not a test: nothing is asserted.

Each variant runs in its own subprocess with the MoRIIO package loaded from a
directory (``vllm_overlay.tree.variant``): the real scheduler-side connector of a
producer finishes the prefill (``request_finished_all_groups``), a consumer
admits the prompt (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``) with position-indexed tables as the KV cache manager
hands them over. The READ pairs in the connector metadata are counted.

Without --old/--new the two directories are written by
``vllm-overlay materialize`` (base, and the whole series) from the installed
vLLM.

Usage: python benchmarks/prefix_hit_reads.py [--old DIR --new DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from vllm_overlay.series.pin import MODULE_DIR

# Kimi-K3-like decode rank: one MLA group (fp8 latent, 1536-token blocks,
# DCP 8 so a page holds 12288 tokens) and three KDA state groups.
DCP = 8
MLA_BLOCK = 1536
MLA_LAYERS = 16  # assumed; bytes scale linearly
KDA_GROUPS = 3
KDA_LAYERS_PER_GROUP = 16
HITS = (0.0, 0.5, 0.897, 1.0)
PROMPTS = (100_000, 8 * MLA_BLOCK * DCP + 1)
_P_BASE = 10_000_000
_D_BASE = 20_000_000
_STRIDE = 100_000


class Row(msgspec.Struct, frozen=True):
    prompt_tokens: int
    hit: float
    local_hit_tokens: int
    external_tokens: int
    attn_pages: int
    attn_bytes: int
    kda_bytes: int


class Measurement(msgspec.Struct, frozen=True):
    label: str
    page_tokens: int
    attn_page_bytes: int
    rows: list[Row]


def measure(directory: Path, label: str) -> Measurement:
    from vllm_overlay.tree.variant import use_moriio_dir

    use_moriio_dir(directory)

    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector import (
        MoRIIOConnector,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
    )
    from vllm.v1.request import Request, RequestStatus

    mla = MLAAttentionSpec(
        block_size=MLA_BLOCK,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.uint8,
        dcp_sharded=True,
    )
    kda = MambaSpec(
        block_size=MLA_BLOCK,
        shapes=((3, 3 * 8 * 128), (8, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
    )
    specs = [mla, *[kda] * KDA_GROUPS]
    page_tokens = MLA_BLOCK * DCP

    tmp = Path(tempfile.mkdtemp(prefix="prefix-hit-model-"))
    (tmp / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
                "vocab_size": 1000,
                "max_position_embeddings": 1 << 20,
            }
        )
    )

    def connector(role: str, port: int) -> MoRIIOConnector:
        vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=str(tmp), skip_tokenizer_init=True, max_model_len=1 << 20
            ),
            cache_config=CacheConfig(block_size=16),
            kv_transfer_config=KVTransferConfig(
                kv_connector="MoRIIOConnector",
                kv_role=role,
                kv_connector_extra_config={
                    "handshake_port": port,
                    "notify_port": port + 1,
                    "proxy_ip": "127.0.0.1",
                    "http_port": port + 2,
                    "host_ip": "127.0.0.1",
                    "read_mode": True,
                },
            ),
        )
        vllm_config.parallel_config.decode_context_parallel_size = DCP
        kv_cache_config = KVCacheConfig(
            num_blocks=1 << 20,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)
            ],
        )
        with set_current_vllm_config(vllm_config):
            return MoRIIOConnector(
                vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
            )

    def table(base: int, group: int, num_tokens: int) -> list[int]:
        if group > 0:
            return [base + group * _STRIDE]
        pages = -(-num_tokens // page_tokens)
        return [base + page for page in range(pages)]

    producer = connector("kv_producer", 26000)
    consumer = connector("kv_consumer", 27000)
    rows: list[Row] = []
    for n, (prompt_tokens, hit) in enumerate((p, h) for p in PROMPTS for h in HITS):
        request_id = f"bench-{n}"
        local_hit = int(hit * (prompt_tokens - 1)) // page_tokens * page_tokens
        prefill = Request(
            request_id,
            list(range(prompt_tokens)),
            SamplingParams(
                max_tokens=1,
                extra_args={
                    "kv_transfer_params": {
                        "do_remote_decode": True,
                        "transfer_id": request_id,
                    }
                },
            ),
            None,
        )
        producer.on_new_request(prefill)
        prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = producer.request_finished_all_groups(
            prefill,
            tuple(
                table(_P_BASE, g, prefill.num_prompt_tokens) for g in range(len(specs))
            ),
        )
        assert params is not None
        decode = Request(
            request_id,
            list(range(prompt_tokens)),
            SamplingParams(
                max_tokens=8, extra_args={"kv_transfer_params": dict(params)}
            ),
            None,
        )
        external, _ = consumer.get_num_new_matched_tokens(decode, local_hit)
        blocks = KVCacheBlocks(
            tuple(
                [KVCacheBlock(b) for b in table(_D_BASE, g, prompt_tokens + 1)]
                for g in range(len(specs))
            )
        )
        consumer.update_state_after_alloc(decode, blocks, external)
        meta = consumer.build_connector_meta(SchedulerOutput.make_empty())
        local = meta.reqs_to_recv[request_id].local_block_ids
        scheduler = consumer.connector_scheduler
        assert scheduler is not None
        num_attn = len(scheduler._attn_group_ids)
        attn_pages = sum(len(group) for group in local[:num_attn])
        kda_slots = sum(len(group) for group in local[num_attn:])
        rows.append(
            Row(
                prompt_tokens=prompt_tokens,
                hit=hit,
                local_hit_tokens=local_hit,
                external_tokens=external,
                attn_pages=attn_pages,
                attn_bytes=attn_pages * mla.page_size_bytes * MLA_LAYERS,
                kda_bytes=kda_slots * kda.page_size_bytes * KDA_LAYERS_PER_GROUP,
            )
        )
    return Measurement(
        label=label,
        page_tokens=page_tokens,
        attn_page_bytes=mla.page_size_bytes * MLA_LAYERS,
        rows=rows,
    )


def run_variant(directory: Path, label: str, out: Path) -> Measurement:
    result = out / f"{label}.json"
    proc = subprocess.run(
        [sys.executable, __file__, "--measure", str(directory)]
        + ["--label", label, "--result", str(result)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{label} measurement in {directory} failed")
    return msgspec.json.decode(result.read_bytes(), type=Measurement)


def materialized(out: Path) -> tuple[Path, Path]:
    dirs = []
    for name, extra in (("old", ["--base"]), ("new", [])):
        subprocess.run(
            [sys.executable, "-m", "vllm_overlay.cli", "materialize"]
            + ["--out", str(out / name), *extra],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        dirs.append(out / name / MODULE_DIR)
    return dirs[0], dirs[1]


def min_pages(row: Row, page_tokens: int) -> int:
    """Pages holding a prompt position the decoder lacks: [L, N-1)."""
    end = row.prompt_tokens - 1
    if row.external_tokens == 0 or row.local_hit_tokens >= end:
        return 0
    return -(-end // page_tokens) - row.local_hit_tokens // page_tokens


def ratio(pages: int, minimum: int) -> str:
    if minimum == 0:
        return "1.00" if pages == 0 else "inf"
    return f"{pages / minimum:.2f}"


def print_table(old: Measurement, new: Measurement) -> None:
    gb = 1e9
    print(
        f"Kimi-K3-like decode rank: MLA {MLA_LAYERS} layers, page "
        f"{old.page_tokens} tokens (block {MLA_BLOCK} x DCP {DCP}), "
        f"{old.attn_page_bytes / gb:.4f} GB per page over all MLA layers; "
        f"{KDA_GROUPS} KDA groups x {KDA_LAYERS_PER_GROUP} layers. "
        "Logical READ payload per request."
    )
    header = (
        f"{'N':>7} {'hit':>6} {'L':>7} {'E':>7} {'min':>4} {'old':>4} "
        f"{'new':>4} {'old GB':>8} {'new GB':>8} {'KDA GB':>8} "
        f"{'old/min':>8} {'new/min':>8}"
    )
    print(header)
    print("-" * len(header))
    for o, n in zip(old.rows, new.rows, strict=True):
        assert (o.prompt_tokens, o.hit) == (n.prompt_tokens, n.hit)
        m = min_pages(o, old.page_tokens)
        print(
            f"{o.prompt_tokens:>7} {o.hit * 100:>5.1f}% {o.local_hit_tokens:>7} "
            f"{o.external_tokens:>7} {m:>4} {o.attn_pages:>4} {n.attn_pages:>4} "
            f"{o.attn_bytes / gb:>8.3f} {n.attn_bytes / gb:>8.3f} "
            f"{n.kda_bytes / gb:>8.3f} {ratio(o.attn_pages, m):>8} "
            f"{ratio(n.attn_pages, m):>8}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="MoRIIO package dir, base")
    parser.add_argument("--new", type=Path, help="MoRIIO package dir, overlaid")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--label", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        result = measure(args.measure, args.label)
        args.result.write_bytes(msgspec.json.encode(result))
        return 0
    with tempfile.TemporaryDirectory(prefix="prefix-hit-") as tmp:
        old_dir, new_dir = args.old, args.new
        if old_dir is None or new_dir is None:
            old_dir, new_dir = materialized(Path(tmp))
        old = run_variant(old_dir, "old", Path(tmp))
        print_table(old, run_variant(new_dir, "new", Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
