"""Per-layer KV cache specs of the model families the pinned vLLM ships.

Each builder returns ``{layer name: KVCacheSpec}`` the way that model's own
layers build their specs in the pinned vLLM (``get_kv_cache_spec`` of its
attention/cache modules, with the block sizes, page sizes and speculative
slots the engine resolves before grouping); its docstring names the file and
function it follows. Dimensions come from the model's configuration class
(``transformers`` or ``vllm.transformers_utils.configs``) where one ships,
otherwise from a representative published configuration, named in the
docstring. Per-rank shapes assume tensor parallelism 8 for the large hybrid
models (their recurrent states are sharded by head).

vLLM's real planner groups these specs (``legs.build_leg``); nothing here
builds groups. Shapes matter to the planner only through page sizes, block
sizes, windows and slot counts, so these are what the builders reproduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from vllm_overlay.simulate.layout_types import (
    Layout,
    QSARawKeyRing,
    Ring,
    SpecDecode,
)

Specs = dict[str, Any]
Shapes = tuple[tuple[int, ...], ...]

_TP = 8  # per-rank shapes of the large hybrid models


def _torch() -> Any:
    import torch

    return torch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _tp_heads(total: int, tp: int) -> int:
    """KV heads of one of ``tp`` ranks: its share, or one replicated head
    past ``total`` ranks."""
    return total // tp if tp <= total else 1


# -- spec constructors, one per vLLM layer kind --------------------------------


def _attention(block: int, kv_heads: int, head: int, window: int | None = None) -> Any:
    """``Attention.get_kv_cache_spec`` (model_executor/layers/attention/
    attention.py): ``FullAttentionSpec``, or ``SlidingWindowSpec`` for a
    windowed layer (at the primary block size when the backend runs it
    unsplit)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    bf16 = _torch().bfloat16
    if window is None:
        return FullAttentionSpec(
            block_size=block, num_kv_heads=kv_heads, head_size=head, dtype=bf16
        )
    return SlidingWindowSpec(
        block_size=block,
        num_kv_heads=kv_heads,
        head_size=head,
        dtype=bf16,
        sliding_window=window,
    )


def _latent(block: int, head: int, dtype: Any, **kw: Any) -> Any:
    """An ``MLAAttentionSpec``: one row per token (or per state), never
    sharded across TP ranks."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return _one_head(MLAAttentionSpec, block, head, dtype, max_tp_shards=1, **kw)


def _mla(block: int, head: int = 576, *, leader: bool = False, **kw: Any) -> Any:
    """``MLAAttention.get_kv_cache_spec`` (model_executor/layers/attention/
    mla_attention.py): one latent vector per token, ``max_tp_shards=1``."""
    dtype = kw.pop("dtype", _torch().bfloat16)
    return _latent(
        block, head, dtype, cache_dtype_str="auto", is_index_group_leader=leader, **kw
    )


def _indexer(block: int, head: int = 132, tokens_per_state: int = 1, **kw: Any) -> Any:
    """``DeepseekV32IndexerCache.get_kv_cache_spec`` (model_executor/models/
    deepseek_v2.py): fp8 keys + fp32 scales (128 + 4 bytes), uint8."""
    from vllm.v1.kv_cache_interface import SparseCacheRole

    dtype = kw.pop("dtype", _torch().uint8)
    role = SparseCacheRole.INDEXER
    return _latent(
        block, head, dtype, cache_role=role, tokens_per_state=tokens_per_state, **kw
    )


def _mamba(
    block: int,
    shapes: Shapes,
    dtypes: tuple[Any, ...],
    num_spec: int,
    page: int | None,
    **kw: Any,
) -> Any:
    """``MambaBase.get_kv_cache_spec`` (model_executor/layers/mamba/
    abstract.py): align mode (prefix caching on), one scratch slot per
    speculative token, the page padded to the attention page."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=block,
        shapes=shapes,
        dtypes=dtypes,
        page_size_padded=page,
        mamba_cache_mode="align",
        num_speculative_blocks=num_spec,
        **kw,
    )


def _mamba_page(shapes: Shapes, dtypes: tuple[Any, ...]) -> int:
    from vllm.v1.kv_cache_interface import MambaSpec

    page: int = MambaSpec(block_size=1, shapes=shapes, dtypes=dtypes).page_size_bytes
    return page


def _hybrid_block(attn_page_per_token: int, mamba_page: int, alignment: int) -> int:
    """The attention block size ``Platform._align_hybrid_block_size``
    (platforms/interface.py) resolves: the smallest multiple of the kernel
    alignment (128 for MLA hybrids) whose page holds a Mamba state."""
    return alignment * _cdiv(mamba_page, alignment * attn_page_per_token)


def _draft(spec: Any) -> Any:
    """``GPUModelRunner.get_kv_cache_spec`` marks a drafter's layers."""
    return replace(spec, is_draft=True)


def _one_head(cls: Any, block: int, head: int, dtype: Any, **kw: Any) -> Any:
    """A spec of ``cls`` with one KV head (a latent, key or state row)."""
    return cls(block_size=block, num_kv_heads=1, head_size=head, dtype=dtype, **kw)


def ring_group(tokens: int) -> dict[str, int]:
    """The group size a ring's model file states on its ``CircularBufferSpec``
    where vLLM's spec has the field (core patch c004: ``compress_ratio``);
    nothing on a vLLM without it."""
    from dataclasses import fields

    from vllm.v1.kv_cache_interface import CircularBufferSpec

    names = {f.name for f in fields(CircularBufferSpec)}
    return {"compress_ratio": tokens} if "compress_ratio" in names else {}


def _bf16_16(cls: Any, kv_heads: int, head: int = 128, **kw: Any) -> Any:
    """A bf16 attention spec of ``cls`` on block 16."""
    return cls(
        block_size=16,
        num_kv_heads=kv_heads,
        head_size=head,
        dtype=_torch().bfloat16,
        **kw,
    )


def _decoder(num_layers: int, spec: Any) -> Specs:
    """``num_layers`` decoder layers sharing one attention spec."""
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}


def _one_in_four(num_layers: int, fourth: Specs, others: Specs) -> Specs:
    """Decoder layers ``model.layers.I.NAME``: every 4th (I % 4 == 3) holds
    the caches ``fourth``, the others ``others``."""
    specs: Specs = {}
    for i in range(num_layers):
        parts = fourth if i % 4 == 3 else others
        _put(specs, f"model.layers.{i}", parts)
    return specs


def _put(specs: Specs, prefix: str, parts: Specs, draft: bool = False) -> None:
    """One layer's caches, ``prefix.NAME`` for each part; a drafter's marked."""
    for name, spec in parts.items():
        specs[f"{prefix}.{name}"] = _draft(spec) if draft else spec


# -- families -------------------------------------------------------------------


def llama3() -> Specs:
    """Llama-3-8B: ``Attention.get_kv_cache_spec`` (model_executor/layers/
    attention/attention.py) via ``LlamaAttention`` (model_executor/models/
    llama.py); 32 layers, 8 KV heads x 128, block 16."""
    return _decoder(32, _attention(16, 8, 128))


def gemma3() -> Specs:
    """Gemma-3-27B: ``Attention.get_kv_cache_spec`` (model_executor/layers/
    attention/attention.py) via ``Gemma3Attention`` (model_executor/models/
    gemma3.py); 62 layers, every 6th global, the others a 1024-token window,
    16 KV heads x 128, block 16."""
    specs: Specs = {}
    for i in range(62):
        window = None if i % 6 == 5 else 1024
        specs[f"model.layers.{i}.self_attn.attn"] = _attention(16, 16, 128, window)
    return specs


def gpt_oss(eagle3: bool = False) -> Specs:
    """gpt-oss-120b: ``Attention.get_kv_cache_spec`` (model_executor/layers/
    attention/attention.py) via ``OAIAttention`` (model_executor/models/
    gpt_oss.py); 36 layers alternating a 128-token window and full
    attention, 8 KV heads x 64, block 16. The EAGLE3 drafter
    (``Eagle3LlamaForCausalLM``, model_executor/models/llama_eagle3.py) adds
    one full-attention layer of the same shape: it joins the target's full
    group."""
    specs: Specs = {}
    for i in range(36):
        window = 128 if i % 2 == 0 else None
        specs[f"model.layers.{i}.self_attn.attn"] = _attention(16, 8, 64, window)
    if eagle3:
        specs["drafter.model.layers.0.self_attn.attn"] = _draft(_attention(16, 8, 64))
    return specs


def deepseek_v3(mtp: bool = False, eagle3: bool = False) -> Specs:
    """DeepSeek-V3: ``MLAAttention.get_kv_cache_spec`` (model_executor/
    layers/attention/mla_attention.py); 61 layers, kv_lora_rank 512 + rope
    64 = 576, block 64. MTP (``DeepSeekMTP``, model_executor/models/
    deepseek_mtp.py) adds one MLA layer of the same spec (shared group). An
    EAGLE3 drafter (``Eagle3DeepseekV2ForCausalLM``, model_executor/models/
    deepseek_eagle3.py: Llama-style GQA, 8 KV heads x 128) has its own spec;
    at the target's block size the planner still puts it in the MLA group
    (both are full attention)."""
    specs: Specs = {f"model.layers.{i}.self_attn.attn": _mla(64) for i in range(61)}
    if mtp:
        specs["model.layers.61.self_attn.attn"] = _draft(_mla(64))
    if eagle3:
        specs["drafter.model.layers.0.self_attn.attn"] = _draft(_attention(64, 8, 128))
    return specs


def deepseek_v32(mtp: bool = False) -> Specs:
    """DeepSeek-V3.2 / GLM-5 (``GlmMoeDsaForCausalLM``): MLA plus the DSA
    indexer key cache, ``DeepseekV32IndexerCache.get_kv_cache_spec``
    (model_executor/models/deepseek_v2.py; vllm/models/deepseek_v32); 61
    layers, block 64; one MTP layer with both caches."""
    specs: Specs = {}
    for i in range(62 if mtp else 61):
        mk = _draft if i == 61 else (lambda s: s)
        specs[f"model.layers.{i}.self_attn.attn"] = mk(_mla(64, leader=True))
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = mk(_indexer(64))
    return specs


def _dsv4_rows(cls: Any, block: int, **kw: Any) -> Any:
    """DeepSeek-V4's bf16 512-wide latent rows, pages aligned to 512 bytes."""
    return _one_head(
        cls,
        block,
        512,
        _torch().bfloat16,
        max_tp_shards=1,
        cache_dtype_str="auto",
        alignment=512,
        model_version="deepseek_v4",
        **kw,
    )


def _dsv4_mla(block: int, ratio: int) -> Any:
    """``DeepseekV4Attention.get_kv_cache_spec`` (vllm/models/deepseek_v4/
    attention.py): bf16 compressed MLA rows, one per ``ratio`` tokens."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return _dsv4_rows(MLAAttentionSpec, block, tokens_per_state=ratio)


def _dsv4_swa(block: int, window: int, bounded_replay: bool = False) -> Any:
    """``DeepseekV4SWACache.get_kv_cache_spec`` (v1/attention/backends/mla/
    sparse_swa.py), bf16 rows, 512-byte page alignment."""
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    return _dsv4_rows(
        SlidingWindowMLASpec,
        block,
        sliding_window=window,
        bounded_replay=bounded_replay,
    )


def _dsv4_compressor_state(ratio: int, head: int) -> Any:
    """``CompressorStateCache.get_kv_cache_spec`` (vllm/models/deepseek_v4/
    compressor.py): fp32 [kv, score] states over an overlapping window of
    ``coff * ratio`` tokens, block 4 (ratio 4) or 8 (ratio 128)."""
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    coff = 1 + (ratio == 4)
    return _one_head(
        SlidingWindowMLASpec,
        4 if ratio == 4 else 8,
        2 * coff * head,
        _torch().float32,
        max_tp_shards=1,
        sliding_window=coff * ratio,
        alignment=512,
    )


def deepseek_v4(mtp: bool = False) -> Specs:
    """DeepSeek-V4-Pro (``DeepseekV4ForCausalLM``, vllm/models/deepseek_v4):
    every layer a 128-token SWA cache (``DeepseekV4SWACache``, v1/attention/
    backends/mla/sparse_swa.py, block 64); the compressed layers a compressed
    MLA cache (``DeepseekV4Attention.get_kv_cache_spec``, attention.py, ratio
    4 or 128, block 256) and a compressor state
    (``CompressorStateCache``); ratio-4 layers also the indexer key cache
    (``DeepseekV4IndexerCache``, ratio 4) and its compressor state. Layer
    types from ``DeepseekV4Config`` (43 layers); the MTP layer is pure SWA."""
    from transformers.models.deepseek_v4 import configuration_deepseek_v4 as cfg

    config = cfg.DeepseekV4Config()
    specs: Specs = {}
    for i, kind in enumerate(config.layer_types):
        ratio = config.compress_rates[kind]
        p = f"model.layers.{i}.attn"
        specs[f"{p}.swa_cache"] = _dsv4_swa(64, config.sliding_window)
        specs[p] = _dsv4_mla(256, ratio)
        specs[f"{p}.compressor.state_cache"] = _dsv4_compressor_state(ratio, 512)
        if ratio == 4:
            specs[f"{p}.indexer.k_cache"] = _indexer(256, tokens_per_state=4)
            specs[f"{p}.indexer.compressor.state_cache"] = _dsv4_compressor_state(
                4, config.index_head_dim
            )
    if mtp:
        n = len(config.layer_types)
        specs[f"model.layers.{n}.attn.swa_cache"] = _draft(
            _dsv4_swa(64, config.sliding_window)
        )
    return specs


def deepseek_v41(num_spec: int = 0) -> Specs:
    """DeepSeek-V4.1 (``DeepseekV41ForCausalLM``, vllm/models/deepseek_v41):
    every layer a 128-token SWA cache (block 32; bounded replay is off on
    ROCm, ``DeepseekV41Attention.__init__``); compressed layers (ratio 1 or
    2) own a compressed MLA cache and the indexer key cache
    (``get_kv_cache_spec`` in attention.py, block 256); ratio-2 layers a
    ``CircularBufferSpec`` ring of the open group's rows
    (``CompressorStateCache.get_kv_cache_spec``, compressor.py: block
    ``max(8, pow2 >= num_spec + 2)``). No default config ships: compress
    ratios follow the (2, 0, 1, 0) pattern over 48 layers, each compressed
    layer its own kv/index source."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    ring = max(8, _next_pow2(num_spec + 2))
    specs: Specs = {}
    for i in range(48):
        ratio = (2, 0, 1, 0)[i % 4]
        p = f"model.layers.{i}.attn"
        specs[f"{p}.swa_cache"] = _dsv4_swa(32, 128)
        if ratio == 0:
            continue
        specs[p] = _dsv4_mla(256, ratio)
        specs[f"{p}.indexer.k_cache"] = _indexer(
            256, tokens_per_state=ratio, alignment=512
        )
        if ratio == 2:
            specs[f"{p}.compressor.state_cache"] = _one_head(
                CircularBufferSpec,
                ring,
                2 * 512,
                _torch().float32,
                head_size_v=0,
                **ring_group(2),
            )
    return specs


def _kda_shapes(heads: int, head_dim: int, conv: int, num_spec: int) -> Shapes:
    """``MambaStateShapeCalculator.kda_state_shape`` (model_executor/layers/
    mamba/mamba_utils.py): conv over q, k, v; a head_dim^2 state per head."""
    conv_dim = (heads * head_dim * 3) // _TP
    return ((conv_dim, conv - 1 + num_spec), (heads // _TP, head_dim, head_dim))


def kimi_k3(num_spec: int = 0) -> Specs:
    """Kimi-K3 (vllm/models/kimi_k3): MLA (``KimiMLAAttention.
    get_kv_cache_spec``, nvidia/mla.py, 576) every 4th layer, KDA
    (``KimiK3DeltaAttention.get_kv_cache_spec``, nvidia/kda.py) otherwise;
    48 layers, 32 KDA heads x 128 (Kimi-Linear dimensions; the shipped
    config has none). Block size from ``_align_hybrid_block_size``. The MTP
    layer and the DSpark drafter are MLA layers of the target's spec."""
    torch = _torch()
    shapes = _kda_shapes(32, 128, 4, num_spec)
    dtypes = (torch.bfloat16, torch.float32)
    block = _hybrid_block(576 * 2, _mamba_page(shapes, dtypes), 128)
    mla = _mla(block)
    kda = _mamba(block, shapes, dtypes, num_spec, mla.page_size_bytes)
    specs = _one_in_four(48, {"self_attn.mla_attn": mla}, {"self_attn.kda": kda})
    if num_spec:
        specs["model.layers.48.self_attn.mla_attn"] = _draft(mla)
    return specs


def glm5next(num_spec: int = 0) -> Specs:
    """GLM-5.3-Flash (``Glm5NextForConditionalGeneration``, vllm/models/
    glm5next): per ``Glm5NextTextConfig.layer_types`` (45 layers), KDA
    layers (``Glm5NextLinearAttention.get_kv_cache_spec``, common/kda.py)
    and indexed-attention layers with MLA (a 512 latent, no rope), the
    kpool indexer key cache (``Glm5NextIndexerCache.get_kv_cache_spec``,
    common/attention.py: ``tokens_per_state = index_kpool``) and the kpool
    tail ring (``Glm5NextTailCache.get_kv_cache_spec``:
    ``CircularBufferSpec``, ring = kpool x pow2(cdiv(kpool + num_spec,
    kpool))). The MTP layer (common/mtp.py) is an indexed-attention layer.
    Block size from ``_align_hybrid_block_size``."""
    from transformers import Glm5NextTextConfig
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    torch = _torch()
    config = Glm5NextTextConfig()
    kpool = config.index_kpool
    shapes = _kda_shapes(
        config.linear_num_heads,
        config.linear_head_dim,
        config.linear_conv_kernel_dim,
        num_spec,
    )
    dtypes = (torch.bfloat16, torch.float32)
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    block = _hybrid_block(latent * 2, _mamba_page(shapes, dtypes), 128)
    ring = kpool * _next_pow2(_cdiv(kpool + num_spec, kpool))
    index_head = config.index_head_dim + config.index_head_dim // 128 * 4
    mla = _mla(block, latent, leader=True)
    kda = _mamba(block, shapes, dtypes, num_spec, mla.page_size_bytes)
    indexer = _indexer(block, index_head, tokens_per_state=kpool)
    tail = CircularBufferSpec(
        block_size=ring,
        num_kv_heads=2,
        head_size=config.index_head_dim,
        head_size_v=0,
        dtype=torch.bfloat16,
        dcp_sharded=False,
        **ring_group(kpool),
    )
    specs: Specs = {}

    def indexed(prefix: str, mk: Callable[[Any], Any]) -> None:
        specs[f"{prefix}.mla_attn"] = mk(mla)
        specs[f"{prefix}.indexer.k_cache"] = mk(indexer)
        specs[f"{prefix}.indexer.tail_cache"] = mk(tail)

    for i, kind in enumerate(config.layer_types):
        if kind == "linear_attention":
            specs[f"model.layers.{i}.linear_attn"] = kda
        else:
            indexed(f"model.layers.{i}.self_attn", lambda s: s)
    if num_spec:
        n = len(config.layer_types)
        indexed(f"model.layers.{n}.mtp_block.self_attn", _draft)
    return specs


def qwen35(num_spec: int = 0, eagle3: bool = False) -> Specs:
    """Qwen3.5 / Qwen3-Next (model_executor/models/qwen3_next.py): Gated
    DeltaNet (``QwenGatedDeltaNetAttention.get_kv_cache_spec``, model_executor/
    layers/mamba/gdn/qwen_gdn_linear_attn.py) on 3 of 4 layers, gated full
    attention (``Attention``, 2 KV heads x 256) on every 4th; 48 layers, 16
    key / 32 value heads x 128. MTP (qwen3_next_mtp.py) adds a full-attention
    layer of the target's spec. An EAGLE3 drafter (llama_eagle3.py, 8 KV
    heads x 128) owns its own attention group."""
    torch = _torch()
    k_heads, v_heads, head = 16, 32, 128
    conv_dim = (head * k_heads * 2 + head * v_heads) // _TP
    shapes = ((conv_dim, 4 - 1 + num_spec), (v_heads // _TP, head, head))
    dtypes = (torch.bfloat16, torch.float32)
    attn_1tok = _attention(1, 2, 256).page_size_bytes
    block = _hybrid_block(attn_1tok, _mamba_page(shapes, dtypes), 16)
    attn = _attention(block, 2, 256)
    gdn = _mamba(block, shapes, dtypes, num_spec, attn.page_size_bytes)
    specs = _one_in_four(48, {"self_attn.attn": attn}, {"linear_attn": gdn})
    if num_spec and not eagle3:
        specs["mtp.layers.0.self_attn.attn"] = _draft(attn)
    if eagle3:
        specs["drafter.model.layers.0.self_attn.attn"] = _draft(
            _attention(block, 8, 128)
        )
    return specs


@dataclass(frozen=True)
class _Qwen4ExpIndexerConfig:
    """The model config fields Qwen4-exp's QSA indexer reads
    (models/qwen4_exp/{amd,nvidia}/qsa_indexer.py: ``config.
    indexer_compress_ratio``, ``config.indexer_head_dim``). No default
    config ships; these are the simulated model's."""

    indexer_compress_ratio: int = 16
    indexer_head_dim: int = 128


QWEN4_EXP_INDEXER = _Qwen4ExpIndexerConfig()


def qwen4_exp(num_spec: int = 0) -> Specs:
    """Qwen4-exp (vllm/models/qwen4_exp): GDN layers (``get_mamba_specs_from_
    config``, nvidia/model.py) and QSA layers: GQA keys/values
    (``Qwen4ExpQSAAttention.get_kv_cache_spec``, nvidia/qsa.py), a ring of
    the open compression group's raw keys (``QSARawKeyCache.
    get_kv_cache_spec``, common/qsa_indexer.py: ``CircularBufferSpec``,
    capacity round_up(ratio + num_spec, ratio)) and one compressed key per
    group (``QSACompressedKeyCache``: ``MLAAttentionSpec``,
    ``tokens_per_state = ratio``); the PLE layer's short-conv state is a
    second, replicated ``MambaSpec``. No default config ships: 40 layers,
    every 4th QSA (``QWEN4_EXP_INDEXER``: compression ratio 16), PLE on
    layer 0."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    torch = _torch()
    ratio = QWEN4_EXP_INDEXER.indexer_compress_ratio
    index_head = QWEN4_EXP_INDEXER.indexer_head_dim
    k_heads, v_heads, head = 16, 32, 128
    conv_dim = (head * k_heads * 2 + head * v_heads) // _TP
    shapes = ((conv_dim, 4 - 1 + num_spec), (v_heads // _TP, head, head))
    dtypes = (torch.bfloat16, torch.float32)
    ple_shapes = ((2048, 3),)
    attn_1tok = _attention(1, 2, 256).page_size_bytes
    block = _hybrid_block(attn_1tok, _mamba_page(shapes, dtypes), 128)
    attn = _attention(block, 2, 256)
    page = attn.page_size_bytes
    gdn = _mamba(block, shapes, dtypes, num_spec, page)
    ple = _mamba(
        block, ple_shapes, (torch.bfloat16,), num_spec, page, tp_replicated=True
    )
    capacity = _round_up(ratio + num_spec, ratio)
    key_ring = _one_head(
        CircularBufferSpec,
        capacity,
        index_head,
        torch.bfloat16,
        head_size_v=0,
        **ring_group(ratio),
    )
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    compressed = _one_head(
        MLAAttentionSpec,
        block,
        index_head,
        torch.bfloat16,
        tokens_per_state=ratio,
    )
    specs: Specs = {"model.layers.0.ple": ple}

    qsa = {
        "attn": attn,
        "key_state_cache": key_ring,
        "compressed_key_cache": compressed,
    }
    for i in range(40):
        if i % 4 == 3:
            _put(specs, f"model.layers.{i}.self_attn", qsa)
        else:
            specs[f"model.layers.{i}.linear_attn"] = gdn
    if num_spec:
        _put(specs, "mtp.layers.0.self_attn", qsa, draft=True)
    return specs


_STEP5_ROW_BYTES = 1024


def step5(num_spec: int = 0, tp: int = 1) -> Specs:
    """Step5 (``Step5ForCausalLM``, vllm/models/step5/nvidia): sliding and
    full attention per ``Step5Config.layer_types`` (``Attention``); full
    layers run DSA with an 8-token region summary cache
    (``Step5SparseSummaryCacheLayer.get_kv_cache_spec``,
    sparse_summary_cache.py: ``FullAttentionSpec``, ``tokens_per_state=8``)
    and the CSA tail ring (``Step5CSATailRing.get_kv_cache_spec``,
    csa_tail_ring.py: ``CircularBufferSpec`` of one main page, 1 KB rows,
    ``7 + num_spec`` rows needed). 48 layers, 1 full per 4, window 512,
    8 KV groups x 128, block 64. At tensor parallelism ``tp`` a rank holds
    its share of the KV groups (``_step5_groups_per_rank``, nvidia/
    model.py) and the ring one page of its own main layer."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec, FullAttentionSpec

    torch = _torch()
    block = 64
    heads = _tp_heads(8, tp)
    main = _attention(block, heads, 128)
    page = main.page_size_bytes
    summary = _one_head(
        FullAttentionSpec,
        block,
        256,
        torch.uint8,
        head_size_v=0,
        tokens_per_state=8,
    )
    ring = _one_head(
        CircularBufferSpec,
        block,
        page // (block * 2),
        torch.bfloat16,
        head_size_v=0,
        block_stride_alignment=_STEP5_ROW_BYTES,
        **ring_group(8),
    )
    full = {"attn": main, "summary_cache": summary, "csa_tail_ring": ring}
    specs: Specs = {}
    for i in range(48):
        if i % 4 == 3:
            _put(specs, f"model.layers.{i}.self_attn", full)
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = _attention(
                block, heads, 128, 512
            )
    if num_spec:
        _put(specs, "model.layers.48.self_attn", full, draft=True)
    return specs


def llama4() -> Specs:
    """Llama-4-Scout (model_executor/models/llama4.py): chunked local
    attention (``ChunkedLocalAttention.get_kv_cache_spec``, model_executor/
    layers/attention/chunked_local_attention.py, chunk 8192) on 3 of 4
    layers, global NoPE full attention on every 4th; 48 layers, 8 KV heads x
    128, block 16."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    specs: Specs = {}
    for i in range(48):
        name = f"model.layers.{i}.self_attn.attn"
        if i % 4 == 3:
            specs[name] = _attention(16, 8, 128)
        else:
            specs[name] = _bf16_16(
                ChunkedLocalAttentionSpec, 8, attention_chunk_size=8192
            )
    return specs


def openpangu_sink() -> Specs:
    """openPangu with parameter sinks (model_executor/models/openpangu.py):
    ``StaticSinkAttention.get_kv_cache_spec`` (model_executor/layers/
    attention/static_sink_attention.py): ``SinkFullAttentionSpec``,
    ``sink_len = param_sink_number`` (a multiple of the block); 32 layers,
    8 KV heads x 128, 128 sink tokens, block 16."""
    from vllm.v1.kv_cache_interface import SinkFullAttentionSpec

    return _decoder(32, _bf16_16(SinkFullAttentionSpec, 8, sink_len=128))


def unlimited_ocr() -> Specs:
    """Unlimited-OCR (``UnlimitedOCRForCausalLM``; its DeepSeek-V2 text
    model builds ``RSWAAttention``; ``RSWAAttention.get_kv_cache_spec``,
    model_executor/layers/attention/rswa_attention.py: ``RSWASpec``,
    ``rswa_window`` 128); 12 layers, 10 KV heads x 128, block 16. The model
    turns prefix caching off (``UnlimitedOCRForCausalLMConfig``,
    model_executor/models/config.py)."""
    from vllm.v1.kv_cache_interface import RSWASpec

    return _decoder(12, _bf16_16(RSWASpec, 10, rswa_window=128))


def llama3_hidden_states() -> Specs:
    """Llama-3-8B with ``speculative_config.method=extract_hidden_states``:
    the target's ``Attention`` layers plus the hidden-state cache layer
    (``CacheOnlyAttentionLayer.get_kv_cache_spec``, model_executor/models/
    extract_hidden_states.py: ``HiddenStateCacheSpec``, heads = the layers
    whose hidden states are kept (4), head size = hidden size 4096)."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    specs = llama3()
    specs["hidden_states_model.cache_layer.attn"] = _bf16_16(
        HiddenStateCacheSpec, 4, head=4096
    )
    return specs


def minimax_m3() -> Specs:
    """MiniMax-M3 (vllm/models/minimax_m3): GQA keys/values
    (``MiniMaxM3SparseAttention.get_kv_cache_spec``, nvidia/model.py) and
    the sparse indexer's key cache (``MiniMaxM3IndexerCache.
    get_kv_cache_spec``, common/indexer.py: ``MLAAttentionSpec``, role
    INDEXER) on every layer; 62 layers, 8 KV heads x 128, index head 128,
    block 64."""
    specs: Specs = {}
    for i in range(62):
        p = f"model.layers.{i}.self_attn"
        specs[f"{p}.attn"] = _attention(64, 8, 128)
        specs[f"{p}.indexer.k_cache"] = _indexer(64, 128, dtype=_torch().bfloat16)
    return specs


def inkling() -> Specs:
    """Inkling (vllm/models/inkling): local layers
    (``InklingAttention.get_kv_cache_spec``, nvidia/attention.py:
    ``SlidingWindowSpec`` over ``local_extent`` 512) and global ones
    (``FullAttentionSpec``), 3:1, plus a short-convolution state kept as a
    sliding window of 4 tokens in its own block size
    (``InklingSconvSWA.get_kv_cache_spec``, nvidia/sconv_swa_attn.py,
    4 streams packed into the head); 32 layers, 8 KV heads x 128, block 16."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    specs: Specs = {}
    for i in range(32):
        window = None if i % 4 == 3 else 512
        specs[f"model.layers.{i}.self_attn.attn"] = _attention(16, 8, 128, window)
        specs[f"model.layers.{i}.sconv"] = SlidingWindowSpec(
            block_size=16,
            num_kv_heads=8,
            head_size=4 * 128,
            head_size_v=0,
            dtype=_torch().bfloat16,
            sliding_window=4,
        )
    return specs


def dots3_note() -> Specs:
    """dots.llm3 NOTE (vllm/models/dots3_note): DSA MLA layers
    (``Dots3NotePaddedMLAAttention.get_kv_cache_spec``, nvidia/model.py:
    MLA padded to the SWA row) and MLA sliding-window layers
    (``MLAAttention.get_kv_cache_spec`` with a window, model_executor/
    layers/attention/mla_attention.py: ``SlidingWindowMLASpec``), 1:3; 48
    layers, 576 rows, window 2048, block 64."""
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    specs: Specs = {}
    for i in range(48):
        name = f"model.layers.{i}.self_attn.attn"
        if i % 4 == 0:
            specs[name] = _mla(64)
        else:
            specs[name] = _one_head(
                SlidingWindowMLASpec,
                64,
                576,
                _torch().bfloat16,
                max_tp_shards=1,
                cache_dtype_str="auto",
                sliding_window=2048,
            )
    return specs


def hisparse_dsv32() -> Specs:
    """DeepSeek-V3.2 with HiSparse host-resident KV (v1/hisparse/layout.py,
    ``get_hisparse_kv_cache_groups``: a host source group plus device-only
    ``HiSparseResidentSpec`` / ``HiSparseHotSpec`` groups); the specs are
    DeepSeek-V3.2's, HiSparse derives the rest."""
    return deepseek_v32()


def lfm3(tp: int = 1) -> Specs:
    """LFM3 (model_executor/models/lfm3.py, the defaults of
    transformers_utils/configs/lfm3.py): ``ShortConv.get_kv_cache_spec``
    (``MambaBase``, model_executor/layers/mamba/short_conv.py; the conv state
    of ``MambaStateShapeCalculator.short_conv_state_shape``, hidden 2048,
    ``conv_L_cache`` 7) on the "conv" layers and ``Attention`` via
    ``Lfm3Attention`` on the others: I % 4 == 2 full attention, I % 4 == 0
    (I > 0) a 256-token window; 24 layers, 4 KV heads x 128: a recurrent
    state beside full and sliding-window groups. At tensor parallelism
    ``tp`` a rank holds ``1 / tp`` of the conv channels and of the KV
    heads, the block size aligned to its own pages."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    dtypes = (_torch().bfloat16,)
    shapes = ((2048 // tp, 7 - 1),)
    heads = _tp_heads(4, tp)
    attn_1tok = _attention(1, heads, 128).page_size_bytes
    block = _hybrid_block(attn_1tok, _mamba_page(shapes, dtypes), 16)
    conv = _mamba(
        block,
        shapes,
        dtypes,
        0,
        _attention(block, heads, 128).page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
    )
    specs: Specs = {}
    for i in range(24):
        if i % 4 == 2:
            specs[f"model.layers.{i}.self_attn.attn"] = _attention(block, heads, 128)
        elif i % 4 == 0 and i > 0:
            specs[f"model.layers.{i}.self_attn.attn"] = _attention(
                block, heads, 128, 256
            )
        else:
            specs[f"model.layers.{i}.short_conv"] = conv
    return specs


def zaya(tp: int = 1) -> Specs:
    """ZAYA (model_executor/models/zaya.py, the defaults of transformers'
    ``ZayaConfig``): every layer holds ``ZayaCCA``'s state
    (``MambaBase.get_kv_cache_spec``, ``get_state_shape``: the raw q/k
    history and the delayed value, replicated on every TP rank) beside its
    ``Attention`` (full; no ``hybrid_sliding`` layer by default); 40 layers,
    8 query / 2 KV heads x 128, ``cca_time0`` = ``cca_time1`` = 2. At tensor
    parallelism ``tp`` a rank holds its share of the KV heads and the whole
    state, the block size aligned to its own pages."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    bf16 = _torch().bfloat16
    shapes = (((8 + 2) * 128, 2 + 2 - 2), (2 * 128 // 2,))
    dtypes = (bf16, bf16)
    heads = _tp_heads(2, tp)
    attn_1tok = _attention(1, heads, 128).page_size_bytes
    block = _hybrid_block(attn_1tok, _mamba_page(shapes, dtypes), 16)
    attn = _attention(block, heads, 128)
    cca = _mamba(
        block,
        shapes,
        dtypes,
        0,
        attn.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
        tp_replicated=True,
    )
    specs: Specs = {}
    for i in range(40):
        specs[f"model.layers.{i}.self_attn.qkv_proj"] = cca
        specs[f"model.layers.{i}.self_attn.attn"] = attn
    return specs


def ricursive(eagle3: bool = False) -> Specs:
    """Ricursive Ripple (model_executor/models/ricursive.py, the defaults of
    transformers_utils/configs/ricursive.py): ``Attention.get_kv_cache_spec``
    via ``RicursiveAttention``; 80 layers, every 5th (I % 5 == 4) global,
    the others a 1024-token window, 8 KV heads x 128, block 16. The EAGLE3
    drafter (``SupportsEagle3``; llama_eagle3.py) adds one full-attention
    layer of the same shape: it joins the target's full group."""
    specs: Specs = {}
    for i in range(80):
        window = None if i % 5 == 4 else 1024
        specs[f"model.layers.{i}.self_attn.attn"] = _attention(16, 8, 128, window)
    if eagle3:
        specs["drafter.model.layers.0.self_attn.attn"] = _draft(_attention(16, 8, 128))
    return specs


# -- the matrix -----------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One row family of the matrix: a model and how it is served."""

    key: str
    title: str
    build: Callable[[], Specs]
    block_size: int
    """The primary (``--block-size``) block; 0: the first full-attention
    spec's, for hybrids whose block the platform derives from the state."""
    speculative: SpecDecode | None = None
    ring: Ring | None = None
    kv_cache_layouts: tuple[str, ...] = ("LBNHC",)
    """Layouts to run: each one that changes vLLM's grouping of the specs."""
    prefix_caching: bool = True
    hisparse: bool = False
    dcp: tuple[int, ...] = (1,)
    per_rank: bool = False
    """``build`` takes ``tp=``: the specs of one rank at that TP size,
    where TP changes more than the GQA layers' KV heads (a page-sized ring,
    a sharded conv state, the block size aligned to them)."""


# Layouts whose grouping changes with the block-outermost KV cache layout.
BOTH = ("LBNHC", "BLNHC")


def _drafted(
    served: Family, method: str, n: int, build: Callable[[], Specs], title: str
) -> Family:
    """``served`` with a drafter proposing ``n`` tokens (``method``), its
    specs built by ``build``; the drafter rows do not run under DCP."""
    return replace(
        served,
        key=f"{served.key}-{method}",
        title=title,
        build=build,
        speculative=SpecDecode(method=method, num_speculative_tokens=n),
        dcp=(1,),
    )


def families() -> list[Family]:
    """Every family of the matrix, in table order."""
    from functools import partial

    glm_kpool = 16
    gpt_oss_f = Family("gpt-oss", "gpt-oss (full + SW 128, 1:1)", gpt_oss, 16)
    dsv3 = Family("deepseek-v3", "DeepSeek-V3 (MLA)", deepseek_v3, 64, dcp=(1, 2))
    dsv32 = Family(
        "deepseek-v3.2", "DeepSeek-V3.2 (MLA + DSA indexer)", deepseek_v32, 64
    )
    dsv4 = Family(
        "deepseek-v4-pro",
        "DeepSeek-V4-Pro (SWA-MLA + compressed MLA + compressor states)",
        deepseek_v4,
        256,
        kv_cache_layouts=BOTH,
    )
    dsv41 = Family(
        "deepseek-v4.1",
        "DeepSeek-V4.1 (compressor ring: CircularBufferSpec)",
        deepseek_v41,
        256,
        ring=Ring(group_tokens=2),
        kv_cache_layouts=BOTH,
    )
    kimi = Family("kimi-k3", "Kimi-K3 (MLA + KDA)", kimi_k3, 0, dcp=(1, 2))
    glm = Family(
        "glm5next",
        "GLM-5.3-Flash (MLA + kpool indexer + tail ring + KDA)",
        glm5next,
        0,
        ring=Ring(group_tokens=glm_kpool),
        kv_cache_layouts=BOTH,
    )
    qwen = Family("qwen3.5", "Qwen3.5 / Qwen3-Next (GDN + full)", qwen35, 0)
    qwen4 = Family(
        "qwen4-exp",
        "Qwen4-exp (GDN + PLE + QSA ring)",
        qwen4_exp,
        0,
        ring=Ring(
            group_tokens=QWEN4_EXP_INDEXER.indexer_compress_ratio,
            qsa_raw_key=QSARawKeyRing(
                compress_ratio=QWEN4_EXP_INDEXER.indexer_compress_ratio,
                head_size=QWEN4_EXP_INDEXER.indexer_head_dim,
            ),
        ),
        kv_cache_layouts=BOTH,
    )
    step = Family(
        "step5",
        "Step5 (SW + DSA summary + CSA tail ring)",
        step5,
        64,
        ring=Ring(group_tokens=8, row_bytes=_STEP5_ROW_BYTES),
        kv_cache_layouts=BOTH,
        per_rank=True,
    )
    ricursive_f = Family(
        "ricursive", "Ricursive Ripple (full + SW 1024, 1:4)", ricursive, 16
    )
    return [
        Family("llama3", "Llama-3 (full)", llama3, 16, dcp=(1, 2)),
        Family("gemma3", "Gemma-3 (full + SW 1024, 1:5)", gemma3, 16),
        gpt_oss_f,
        _drafted(
            gpt_oss_f,
            "eagle3",
            3,
            partial(gpt_oss, eagle3=True),
            "gpt-oss + EAGLE3 (drafter in the full group)",
        ),
        dsv3,
        _drafted(dsv3, "mtp", 1, partial(deepseek_v3, mtp=True), "DeepSeek-V3 + MTP"),
        _drafted(
            dsv3,
            "eagle3",
            3,
            partial(deepseek_v3, eagle3=True),
            "DeepSeek-V3 + EAGLE3 (GQA drafter, grouped with the MLA target)",
        ),
        _drafted(
            dsv32,
            "mtp",
            1,
            partial(deepseek_v32, mtp=True),
            "DeepSeek-V3.2 / GLM-5 (MLA + DSA indexer) + MTP",
        ),
        dsv4,
        _drafted(
            dsv4, "mtp", 1, partial(deepseek_v4, mtp=True), "DeepSeek-V4-Pro + MTP"
        ),
        dsv41,
        _drafted(dsv41, "mtp", 1, partial(deepseek_v41, 1), "DeepSeek-V4.1 + MTP"),
        kimi,
        _drafted(kimi, "mtp", 1, partial(kimi_k3, 1), "Kimi-K3 + MTP"),
        glm,
        _drafted(glm, "mtp", 1, partial(glm5next, 1), "GLM-5.3-Flash + MTP"),
        qwen,
        _drafted(qwen, "mtp", 1, partial(qwen35, 1), "Qwen3.5 + MTP"),
        _drafted(
            replace(qwen, kv_cache_layouts=BOTH),
            "eagle3",
            3,
            partial(qwen35, 3, eagle3=True),
            "Qwen3.5 + EAGLE3 (hybrid, drafter owns a group)",
        ),
        _drafted(
            qwen4,
            "mtp",
            1,
            partial(qwen4_exp, 1),
            "Qwen4-exp (GDN + PLE + QSA ring) + MTP",
        ),
        _drafted(
            step,
            "mtp",
            1,
            partial(step5, 1),
            "Step5 (SW + DSA summary + CSA tail ring) + MTP",
        ),
        Family("llama4", "Llama-4 (chunked local 8192 + full, 3:1)", llama4, 16),
        Family(
            "openpangu-sink", "openPangu (SinkFullAttentionSpec)", openpangu_sink, 16
        ),
        Family(
            "unlimited-ocr",
            "Unlimited-OCR (RSWASpec; prefix caching off)",
            unlimited_ocr,
            16,
            prefix_caching=False,
        ),
        Family(
            "llama3-hidden-states",
            "Llama-3 + extract_hidden_states (HiddenStateCacheSpec)",
            llama3_hidden_states,
            16,
        ),
        Family("minimax-m3", "MiniMax-M3 (GQA + indexer)", minimax_m3, 64),
        Family(
            "inkling",
            "Inkling (local + global + sconv window)",
            inkling,
            16,
            kv_cache_layouts=BOTH,
        ),
        Family("dots3-note", "dots.llm3 NOTE (MLA + SW-MLA)", dots3_note, 64),
        Family("lfm3", "LFM3 (ShortConv + full + SW 256)", lfm3, 0, per_rank=True),
        Family("zaya", "ZAYA (CCA state + full, every layer)", zaya, 0, per_rank=True),
        ricursive_f,
        _drafted(
            ricursive_f,
            "eagle3",
            3,
            partial(ricursive, eagle3=True),
            "Ricursive Ripple + EAGLE3 (drafter in the full group)",
        ),
        Family(
            "deepseek-v3.2-hisparse",
            "DeepSeek-V3.2 + HiSparse (HiSparseHot/ResidentSpec)",
            hisparse_dsv32,
            64,
            hisparse=True,
        ),
    ]


def _rank_builder(fam: Family) -> Callable[[int], Specs] | None:
    if not fam.per_rank:
        return None
    build = fam.build
    return lambda tp: build(tp=tp)  # type: ignore[call-arg]


def _entries() -> list[tuple[Layout, tuple[int, ...]]]:
    out = []
    for fam in families():
        for kv_layout in fam.kv_cache_layouts:
            name = fam.key if kv_layout == "LBNHC" else f"{fam.key}-{kv_layout}"
            build = getattr(fam.build, "func", fam.build)
            layout = Layout(
                name=name,
                block_size=fam.block_size,
                build_specs=fam.build,
                note=fam.title + ("" if kv_layout == "LBNHC" else f", {kv_layout}"),
                family=fam.title,
                source=" ".join((build.__doc__ or "").split()).replace("/ ", "/"),
                kv_cache_layout=kv_layout,
                speculative=fam.speculative,
                ring=fam.ring,
                prefix_caching=fam.prefix_caching,
                hisparse=fam.hisparse,
                build_rank_specs=_rank_builder(fam),
            )
            out.append((layout, fam.dcp))
    return out


def family_layouts() -> dict[str, Layout]:
    """One ``Layout`` per family and KV cache layout that changes grouping."""
    return {layout.name: layout for layout, _ in _entries()}


def family_dcp_sizes() -> dict[str, tuple[int, ...]]:
    return {layout.name: dcp for layout, dcp in _entries()}
