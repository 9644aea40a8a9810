"""Pages and bytes a MoRIIO READ moves per request, base vs the overlay, on
one decode rank of a Llama-3.1-70B-like, a DSv4-Pro-like and a Kimi-K3-like
model (TP8; Kimi-K3 with DCP8), at decoder prefix hits of 0/50/89.7/100 %.
A figure, not a test: nothing is asserted.

Each variant runs in its own subprocess with the MoRIIO package loaded from a
directory (``vllm_overlay.tree.variant``): the real scheduler-side connector of a
producer finishes the prefill (``request_finished_all_groups``), a consumer
admits the prompt (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``) with position-indexed tables as the KV cache manager
hands them over. The READ pairs in the connector metadata are counted.

Without --old/--new the two directories are written by
``vllm-overlay materialize`` (base, and the whole series) from the installed
vLLM.

Shapes per rank (assumed where noted; bytes scale linearly with layers):
- Llama-3.1-70B-like: 80 layers, GQA 8 KV heads / TP8 = 1 per rank, head 128,
  bf16, block 16; one full-attention group, no state.
- DSv4-Pro-like: 43 layers, each an MLA cache (latent 512, bf16, block 64) and
  a 128-token sliding-window MLA cache (block 64); compression, indexer and
  compressor states left out (one entry per token).
- Kimi-K3-like: 16 MLA layers (fp8 latent 576, block 1536, DCP 8: a page holds
  12288 tokens) and 3 KDA state groups of 16 layers.

Usage: python benchmarks/prefix_hit_reads.py [--old DIR --new DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from vllm_overlay.series.pin import MODULE_DIR

HITS = (0.0, 0.5, 0.897, 1.0)
_P_BASE = 10_000_000
_D_BASE = 20_000_000
_STRIDE = 100_000
_NULL = 0  # vLLM's null block: a window page the scheduler has freed


class GroupShape(msgspec.Struct, frozen=True):
    kind: str  # "full" | "window" | "state"
    block_size: int
    layers: int
    head_size: int = 0
    dtype: str = "bfloat16"
    num_kv_heads: int = 1
    window: int = 0
    dcp_sharded: bool = False


class Model(msgspec.Struct, frozen=True):
    name: str
    dcp: int
    groups: list[GroupShape]
    prompts: list[int]


MODELS = [
    Model(
        "Llama-3.1-70B-like TP8",
        1,
        [GroupShape("full", 16, 80, head_size=128)],
        [8_000, 100_000],
    ),
    Model(
        "DSv4-Pro-like TP8",
        1,
        [
            GroupShape("full", 64, 43, head_size=512),
            GroupShape("window", 64, 43, head_size=512, window=128),
        ],
        [8_000, 100_000],
    ),
    Model(
        "Kimi-K3-like TP8/DCP8",
        8,
        [
            GroupShape(
                "full", 1536, 16, head_size=576, dtype="uint8", dcp_sharded=True
            ),
            *[GroupShape("state", 1536, 16)] * 3,
        ],
        [100_000, 8 * 1536 * 8 + 1],
    ),
]


class Row(msgspec.Struct, frozen=True):
    model: str
    prompt_tokens: int
    hit: float
    local_hit_tokens: int
    external_tokens: int
    pages: int
    min_pages: int
    bytes_read: int
    min_bytes: int
    error: str = ""


def measure(directory: Path) -> list[Row]:
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
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
    )
    from vllm.v1.request import Request, RequestStatus

    def spec(shape: GroupShape) -> KVCacheSpec:
        dtype = getattr(torch, shape.dtype)
        if shape.kind == "state":
            return MambaSpec(
                block_size=shape.block_size,
                shapes=((3, 3 * 8 * 128), (8, 128, 128)),
                dtypes=(torch.bfloat16, torch.float32),
                mamba_cache_mode="align",
            )
        if shape.kind == "window":
            return SlidingWindowMLASpec(
                block_size=shape.block_size,
                num_kv_heads=1,
                head_size=shape.head_size,
                dtype=dtype,
                sliding_window=shape.window,
            )
        if shape.head_size in (512, 576):
            return MLAAttentionSpec(
                block_size=shape.block_size,
                num_kv_heads=1,
                head_size=shape.head_size,
                dtype=dtype,
                dcp_sharded=shape.dcp_sharded,
            )
        return FullAttentionSpec(
            block_size=shape.block_size,
            num_kv_heads=shape.num_kv_heads,
            head_size=shape.head_size,
            dtype=dtype,
        )

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
    ports = iter(range(26000, 30000, 10))

    def connector(model: Model, specs: list[KVCacheSpec], role: str) -> Any:
        port = next(ports)
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
        vllm_config.parallel_config.decode_context_parallel_size = model.dcp
        kv_cache_config = KVCacheConfig(
            num_blocks=1 << 20,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)
            ],
        )
        with set_current_vllm_config(vllm_config):
            return MoRIIOConnector(
                vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
            )

    rows: list[Row] = []
    for model in MODELS:
        specs = [spec(shape) for shape in model.groups]
        page_tokens = [
            shape.block_size * (model.dcp if shape.dcp_sharded else 1)
            for shape in model.groups
        ]
        page_bytes = [
            s.page_size_bytes * shape.layers
            for s, shape in zip(specs, model.groups, strict=True)
        ]
        hybrid = any(shape.kind == "state" for shape in model.groups)

        def table(base: int, g: int, num_tokens: int, window_end: int) -> list[int]:
            """Position-indexed; window pages wholly below the window of the
            leg's last token are the null block (vLLM frees them)."""
            shape = model.groups[g]  # noqa: B023
            if shape.kind == "state":
                return [base + g * _STRIDE]
            pt = page_tokens[g]  # noqa: B023
            pages = -(-num_tokens // pt)
            out = [base + g * _STRIDE + k for k in range(pages)]
            if shape.kind == "window":
                first = max(window_end - shape.window, 0) // pt
                out[:first] = [_NULL] * first
            return out

        def lacked(n: int, local_hit: int) -> list[int]:
            """Pages per group the decoder lacks for its last prompt token."""
            last = n - 1
            out = []
            for g, shape in enumerate(model.groups):  # noqa: B023
                pt = page_tokens[g]  # noqa: B023
                if shape.kind == "state":
                    out.append(int(local_hit < last and last > 0))
                    continue
                start = local_hit
                if shape.kind == "window":
                    start = max(local_hit, n - shape.window)
                out.append(max(-(-last // pt) - start // pt, 0) if start < last else 0)
            return out

        producer = connector(model, specs, "kv_producer")
        consumer = connector(model, specs, "kv_consumer")
        align = max(page_tokens)
        for prompt_tokens in model.prompts:
            for hit in HITS:
                request_id = f"bench-{len(rows)}"
                local_hit = int(hit * (prompt_tokens - 1)) // align * align
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
                computed = prefill.num_prompt_tokens
                prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
                _, params = producer.request_finished_all_groups(
                    prefill,
                    tuple(
                        table(_P_BASE, g, computed, computed) for g in range(len(specs))
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
                need = lacked(prompt_tokens, local_hit)
                min_pages = sum(need)
                min_bytes = sum(k * b for k, b in zip(need, page_bytes, strict=True))
                external, _ = consumer.get_num_new_matched_tokens(decode, local_hit)
                blocks = KVCacheBlocks(
                    tuple(
                        [
                            KVCacheBlock(b)
                            for b in table(_D_BASE, g, prompt_tokens + 1, local_hit)
                        ]
                        for g in range(len(specs))
                    )
                )
                row = dict(
                    model=model.name,
                    prompt_tokens=prompt_tokens,
                    hit=hit,
                    local_hit_tokens=local_hit,
                    external_tokens=external,
                    min_pages=min_pages,
                    min_bytes=min_bytes,
                )
                try:
                    consumer.update_state_after_alloc(decode, blocks, external)
                    meta = consumer.build_connector_meta(SchedulerOutput.make_empty())
                except Exception as exc:  # a refusal is a figure too
                    rows.append(
                        Row(**row, pages=0, bytes_read=0, error=type(exc).__name__)
                    )
                    continue
                recv = meta.reqs_to_recv[request_id]
                scheduler = consumer.connector_scheduler
                assert scheduler is not None
                order = [*scheduler._attn_group_ids, *scheduler._mamba_group_ids]
                if not hybrid:
                    order = list(range(len(specs)))
                pages = bytes_read = 0
                for slot, g in enumerate(order):
                    read = [b for b in recv.local_block_ids[slot] if b != _NULL]
                    pages += len(read)
                    bytes_read += len(read) * page_bytes[g]
                rows.append(Row(**row, pages=pages, bytes_read=bytes_read))
    return rows


def run_variant(directory: Path, label: str, out: Path) -> list[Row]:
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
    return msgspec.json.decode(result.read_bytes(), type=list[Row])


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


def ratio(num: int, den: int) -> str:
    if den == 0:
        return "1.00" if num == 0 else "inf"
    return f"{num / den:.2f}"


def print_table(old: list[Row], new: list[Row]) -> None:
    gb = 1e9
    print(
        "Logical READ payload per request on one decode rank (pages over all "
        "groups; GB over all layers); min = what the decoder lacks."
    )
    header = (
        f"{'model':<22} {'N':>7} {'hit':>6} {'L':>7} {'E':>7} {'min':>5} "
        f"{'base':>5} {'ovl':>5} {'min GB':>8} {'base GB':>8} {'ovl GB':>8} "
        f"{'base/min':>8} {'ovl/min':>8}"
    )
    print(header)
    print("-" * len(header))
    for o, n in zip(old, new, strict=True):
        assert (o.model, o.prompt_tokens, o.hit) == (n.model, n.prompt_tokens, n.hit)
        base = o.error or str(o.pages)
        ovl = n.error or str(n.pages)
        print(
            f"{o.model:<22} {o.prompt_tokens:>7} {o.hit * 100:>5.1f}% "
            f"{n.local_hit_tokens:>7} {n.external_tokens:>7} {n.min_pages:>5} "
            f"{base:>5} {ovl:>5} {n.min_bytes / gb:>8.3f} "
            f"{o.bytes_read / gb:>8.3f} {n.bytes_read / gb:>8.3f} "
            f"{ratio(o.bytes_read, o.min_bytes):>8} "
            f"{ratio(n.bytes_read, n.min_bytes):>8}"
        )
    total = [sum(r.bytes_read for r in rows) for rows in (old, new)]
    print(
        f"prefix_hit_reads: {len(new)} requests; base {total[0] / gb:.2f} GB, "
        f"overlay {total[1] / gb:.2f} GB READ"
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
        args.result.write_bytes(msgspec.json.encode(measure(args.measure)))
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
