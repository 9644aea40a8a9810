"""A rank's KV cache: vLLM's per-layer views over one shared-memory buffer.

``allocate_shared_kv_cache`` does what vLLM's ``allocate_kv_cache``
(``v1/worker/utils.py``) does on ROCm, where MoRIIO runs (one backing buffer
padded to whole 4 KiB pages, one ``create_kv_cache_views`` call per KV cache
tensor), except that the buffer is a shared file mapping under /dev/shm: the
loopback ``mori`` stand-in reaches a peer's registered memory through it.
Layers view it exactly as vLLM's model runner hands them to
``register_kv_caches``. Unlike vLLM's zeroed buffer, each leg's starts filled
with its own canary byte.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

PAGE = 4096
MAX_BYTES = 2 << 30
"""Per rank: every rank's buffer lives in /dev/shm, on a 24 GB machine."""


@dataclass
class LayerView:
    name: str
    group: int
    spec: Any
    tensor: Any
    """The ``[B, H, N, C]`` view registered with the connector."""
    u8: np.ndarray
    """The same memory as ``uint8``, ``[B, H, N, C bytes]``."""

    @property
    def page_bytes(self) -> int:
        return int(np.prod(self.u8.shape[1:]))


class SharedKV:
    """The buffer, its layer views, and byte-level snapshots of it."""

    def __init__(
        self,
        kv_cache_config: Any,
        layout_name: str,
        path: str,
        canary: int,
        zero: int = 0,
    ) -> None:
        import torch
        from vllm.v1.kv_cache_interface import (
            UniformTypeKVCacheSpecs,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout

        sizes = {t.size for t in kv_cache_config.kv_cache_tensors}
        assert len(sizes) == 1, "KV cache tensors must share one backing allocation"
        raw = sizes.pop()
        if raw > MAX_BYTES:
            raise ValueError(
                f"byte simulator: a KV cache of {raw / 2**30:.1f} GiB per rank "
                f"exceeds its {MAX_BYTES // 2**30} GiB budget"
            )
        self.nbytes = -(-raw // PAGE) * PAGE
        self.path = path
        self.buffer = torch.from_file(
            path, shared=True, size=self.nbytes, dtype=torch.int8
        )
        self.bytes: np.ndarray = self.buffer.numpy().view(np.uint8)
        # Each leg starts from its own byte: any stray copy of bytes nobody
        # wrote changes the destination, so the byte diff sees it.
        self.bytes[:] = canary
        self.zero = zero
        self._snap: np.ndarray | None = None
        layout = KVCacheLayout[layout_name]
        group_of = {
            name: g
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.tensors: dict[str, Any] = {}
        self.layers: dict[str, LayerView] = {}
        for tensor in kv_cache_config.kv_cache_tensors:
            group = kv_cache_config.kv_cache_groups[group_of[tensor.layers[0]]]
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[tensor.layers[0]]
            views = create_kv_cache_views(
                self.buffer,
                spec,
                kv_cache_config.num_blocks_of(tensor),
                layout,
                tensor,
            )
            for name, view in zip(tensor.layers, views, strict=True):
                self.tensors[name] = view
                layer_spec = group.kv_cache_spec
                if isinstance(layer_spec, UniformTypeKVCacheSpecs):
                    layer_spec = layer_spec.kv_cache_specs[name]
                self.layers[name] = LayerView(
                    name,
                    group_of[name],
                    layer_spec,
                    view,
                    view.view(torch.uint8).numpy(),
                )

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def layers_of(self, group: int) -> list[LayerView]:
        return [layer for layer in self.layers.values() if layer.group == group]

    def page_offset(self, layer: LayerView, block: int) -> int:
        page = layer.u8[block]
        return int(page.ctypes.data - self.bytes.ctypes.data)

    def page_intervals(self, layer: LayerView, block: int) -> list[tuple[int, int]]:
        """The byte ranges ``[start, end)`` of one (layer, block) page: one
        when the page is contiguous, else one per contiguous sub-array."""
        base = self.bytes.ctypes.data
        out: list[tuple[int, int]] = []
        stack = [layer.u8[block]]
        while stack:
            arr = stack.pop()
            if arr.flags.c_contiguous:
                start = arr.ctypes.data - base
                out.append((start, start + arr.nbytes))
            else:
                stack.extend(arr[i] for i in range(arr.shape[0] - 1, -1, -1))
        return out

    def snapshot(self) -> None:
        """Keep a copy of the buffer for ``stray_bytes`` (one reused array)."""
        if self._snap is None:
            self._snap = np.empty_like(self.bytes)
        np.copyto(self._snap, self.bytes)

    def stray_bytes(self, pages: Iterable[tuple[LayerView, int]]) -> np.ndarray:
        """Offsets of the bytes changed since ``snapshot`` outside ``pages``.

        Compares 8-byte words, then tests only the changed words against the
        pages' merged byte ranges; a word a range boundary cuts is resolved
        byte by byte. Same result as comparing every byte against a mask of
        the pages, in a fraction of the passes over the buffer.
        """
        assert self._snap is not None, "stray_bytes before snapshot"
        cur, snap = self.bytes, self._snap
        words = np.flatnonzero(cur.view(np.uint64) != snap.view(np.uint64))
        if words.size == 0:
            return words
        spans = sorted(
            {
                span
                for layer, block in pages
                for span in self.page_intervals(layer, block)
            }
        )
        starts: list[int] = []
        ends: list[int] = []
        for start, end in spans:
            if ends and start <= ends[-1]:
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        starts_arr = np.asarray(starts, dtype=np.int64)
        lo = words * 8
        i = np.searchsorted(starts_arr, lo, side="right") - 1
        ends_arr = np.asarray(ends + [0], dtype=np.int64)
        inside = (i >= 0) & (lo + 8 <= ends_arr[i])
        suspect = words[~inside]
        if suspect.size == 0:
            return suspect
        offsets = (suspect[:, None] * 8 + np.arange(8)).reshape(-1)
        offsets = offsets[cur[offsets] != snap[offsets]]
        j = np.searchsorted(starts_arr, offsets, side="right") - 1
        within = (j >= 0) & (offsets < ends_arr[j])
        return offsets[~within]

    def zero_blocks(self, blocks: Iterable[int]) -> None:
        """vLLM zeroes every layer's page of a freshly allocated block (the
        prefill leg uses its own byte: zeros it never wrote must not look
        like the decoder's)."""
        blocks = list(blocks)
        if not blocks:
            return
        for layer in self.layers.values():
            layer.u8[blocks] = self.zero

    def copy_block(self, src: int, dst: int, group: int | None = None) -> None:
        for layer in self.layers.values():
            if group is None or layer.group == group:
                layer.u8[dst] = layer.u8[src]
