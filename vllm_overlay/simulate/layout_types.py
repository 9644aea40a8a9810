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
