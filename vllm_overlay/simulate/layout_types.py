"""The types a KV cache layout is made of: ``Layout`` (per-layer vLLM spec
objects, built on demand), its speculative slots and ring. The registry of
layouts (mechanism and model families) is ``layouts.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SpecSlots:
    """Slot counts a leg's speculative config gives the scheduler/connector."""

    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0


@dataclass(frozen=True)
class SpecDecode:
    """A real ``SpeculativeConfig`` for both legs (resolved offline)."""

    method: str
    num_speculative_tokens: int


@dataclass(frozen=True)
class QSARawKeyRing:
    """A ring vLLM builds as Qwen4 exp's QSA raw-key ring layer
    (``QSARawKeyCache``, models/qwen4_exp/common/qsa_indexer.py), which
    states its compression group size (``compress_ratio``) on the layer
    object. The simulated workers build the real layer for each ring layer
    of the specs, as the model's QSA indexer does
    (``legs.build_ring_layers``)."""

    compress_ratio: int
    """The model config's ``indexer_compress_ratio``."""
    head_size: int
    """The model config's ``indexer_head_dim``."""


@dataclass(frozen=True)
class Ring:
    """What a ``CircularBufferSpec`` group holds for the checker.

    The ring keeps the raw rows of the still-open compression group: the
    decoder computing position p needs positions
    ``[p // group_tokens * group_tokens, p)`` in it. ``capacity``: positions
    the ring holds (slot = position % capacity); 0 means the rank's page in
    rows of ``row_bytes`` when those are set (a ring sized to its rank's
    page, as Step5's), else the block size the model declares (the planner
    can give the group a larger one).
    """

    group_tokens: int
    capacity: int = 0
    row_bytes: int = 0
    """Bytes of one row in a head's part of the page; 0 means one row of the
    layer's ``[H, N, C]`` view (the model addresses rows of its own size
    when they differ, as Step5's tail ring does)."""
    qsa_raw_key: QSARawKeyRing | None = None
    """The ring's layers are Qwen4 exp's QSA raw-key ring layers; None: the
    simulated workers build no layer object of the ring (vLLM's model code
    keeps its group size private or nowhere)."""


@dataclass(frozen=True)
class Layout:
    name: str
    block_size: int
    """The primary block size; 0 derives it from the first full-attention
    spec (hybrids, whose block the platform sizes to the state page)."""
    build_specs: Callable[[], dict[str, Any]]
    """{layer name: KVCacheSpec}; DCP shards attention specs via the config."""
    dcp: int = 1
    has_state: bool = False
    """Mamba/KDA state groups present (mamba_cache_mode="align"); also
    derived from the specs."""
    prefill_slots: SpecSlots = field(default_factory=SpecSlots)
    decode_slots: SpecSlots = field(default_factory=SpecSlots)
    note: str = ""
    family: str = ""
    """Model family (matrix row); empty for mechanism layouts."""
    source: str = ""
    """The vLLM file and function whose spec construction the layout follows."""
    kv_cache_layout: str = "LBNHC"
    speculative: SpecDecode | None = None
    ring: Ring | None = None
    prefix_caching: bool = True
    hisparse: bool = False
    build_rank_specs: Callable[[int], dict[str, Any]] | None = None
    """{layer name: KVCacheSpec} of one rank at a TP size, when the model's
    code builds them per rank beyond splitting KV heads; None: derived from
    ``build_specs`` (``simulate/bytes/geometry.py``)."""

    def layer_specs(self) -> dict[str, Any]:
        return self.build_specs()

    def register_specs(self) -> None:
        """Register spec classes vLLM does not ship (none at present)."""
