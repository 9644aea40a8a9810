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

import ctypes
import functools
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

PAGE = 4096
_CHUNK = 1 << 24
"""Bytes ``_differing`` compares per ``memcmp`` once the buffers differ."""
MAX_BYTES = 2 << 30
"""Per rank: every rank's buffer lives in /dev/shm, on a 24 GB machine."""
SNAPSHOT_SUFFIX = "-snapshot"
"""The snapshot's file: the buffer's path and this."""


@dataclass
class LayerView:
    name: str
    group: int
    spec: Any
    tensor: Any
    """The ``[B, H, N, C]`` view registered with the connector."""
    u8: np.ndarray
    """The same memory as ``uint8``, ``[B, H, N, C bytes]``."""

    @functools.cached_property
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
        self.buffer = torch.frombuffer(_map_file(path, self.nbytes), dtype=torch.int8)
        self.bytes: np.ndarray = self.buffer.numpy().view(np.uint8)
        # Each leg starts from its own byte: any stray copy of bytes nobody
        # wrote changes the destination, so the byte diff sees it. The file
        # may hold an earlier configuration's bytes: all of them go.
        self.bytes.fill(canary)
        self.zero = zero
        self._snap: np.ndarray | None = None
        self._touched: dict[str, set[int]] | None = None
        """Pages written since the copy last equalled the buffer, by layer
        name; None before the first snapshot."""
        self.full_snapshots = 0
        """Snapshots that copied the whole buffer."""
        layout = KVCacheLayout[layout_name]
        group_of = {
            name: g
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.tensors: dict[str, Any] = {}
        self.layers: dict[str, LayerView] = {}
        self._by_group: dict[int, list[LayerView]] = {}
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
        # A hybrid's groups share tensors: layers whose views cover the same
        # bytes the same way are one memory, written and copied once.
        first: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
        self._root: dict[str, str] = {}
        for name, layer in self.layers.items():
            key = (layer.u8.ctypes.data, layer.u8.shape, layer.u8.strides)
            self._root[name] = first.setdefault(key, name)
        self._distinct = [self.layers[name] for name in first.values()]
        self._origin = {
            name: self.page_offset(layer, 0) for name, layer in self.layers.items()
        }
        self._dense = all(_dense(layer.u8[0]) for layer in self.layers.values())
        """Every layer's page fills one range of the buffer: snapshots and
        the stray search work on merged byte ranges (``_spans``)."""

    def close(self) -> None:
        """Let go of the buffer and the snapshot; their files stay for the
        next configuration's rank (``_map_file``), whose owner removes them
        (``shm.remove_shm``). The mappings end with the last view of them
        (the connector of a closed rank may keep its tensors a while)."""
        self._snap = None

    def layers_of(self, group: int) -> list[LayerView]:
        """The group's layers, in ``layers`` order (one list per group, kept:
        the judge asks for it per need)."""
        found = self._by_group.get(group)
        if found is None:
            found = [layer for layer in self.layers.values() if layer.group == group]
            self._by_group[group] = found
        return found

    def page_offset(self, layer: LayerView, block: int) -> int:
        page = layer.u8[block]
        return int(page.ctypes.data - self.bytes.ctypes.data)

    def touch(self, layer: LayerView, blocks: Iterable[int]) -> None:
        """Note pages this process wrote through ``layer``: the next
        ``snapshot`` copies them, not the whole buffer. Every write of the
        rank's own goes through here, ``zero_blocks`` or ``copy_block``."""
        if self._touched is not None:
            self._touched.setdefault(self._root[layer.name], set()).update(blocks)

    def touched_pages(self) -> list[tuple[LayerView, int]]:
        """The pages noted by ``touch`` since the last ``snapshot`` or
        ``stray_bytes``: this process's own writes."""
        return [
            (self.layers[name], b)
            for name, blocks in (self._touched or {}).items()
            for b in blocks
        ]

    def snapshot(self, skip: Iterable[tuple[LayerView, int]] = ()) -> None:
        """Make the copy ``stray_bytes`` compares with equal to what this
        rank wrote (one reused array): the whole buffer the first time, then
        the pages noted by ``touch`` since the last ``stray_bytes``, but for
        the pages in ``skip`` (the next ``stray_bytes``'s pages: compared
        around, copied after).

        Nothing else may change the buffer between a judge and the next
        arm: a byte anybody else changed meanwhile (a late transfer, a write
        not noted) stays different from the copy, and the next
        ``stray_bytes`` reports it unless it lies in that case's pages.
        """
        if self._snap is None or self._touched is None:
            if self._snap is None:
                self._snap = np.frombuffer(
                    _map_file(self.path + SNAPSHOT_SUFFIX, self.nbytes), np.uint8
                )
            self.full_snapshots += 1
            np.copyto(self._snap, self.bytes)
            self._touched = {}
            return
        skipped: dict[str, set[int]] = {}
        for layer, block in skip:
            skipped.setdefault(self._root[layer.name], set()).add(block)
        touched = {
            name: blocks - skipped.get(name, set())
            for name, blocks in self._touched.items()
        }
        if self._dense:
            pages = [
                (self.layers[name], b)
                for name, blocks in touched.items()
                for b in blocks
            ]
            for lo, hi in self._spans(pages):
                self._snap[lo:hi] = self.bytes[lo:hi]
        else:
            for name, blocks in touched.items():
                if not blocks:
                    continue
                layer = self.layers[name]
                index = np.fromiter(blocks, dtype=np.intp, count=len(blocks))
                self._snap_view(layer)[index] = layer.u8[index]
        self._touched = {}

    def _spans(self, pages: Iterable[tuple[LayerView, int]]) -> list[list[int]]:
        """The byte ranges ``[lo, hi)`` of ``pages`` (``_dense`` layers),
        ascending, overlapping and adjacent ones merged."""
        by_layer: dict[str, list[int]] = {}
        for layer, block in pages:
            by_layer.setdefault(layer.name, []).append(block)
        if not by_layer:
            return []
        los = []
        sizes = []
        for name, blocks in by_layer.items():
            layer = self.layers[name]
            stride = layer.u8.strides[0]
            los.append(self._origin[name] + np.asarray(blocks, np.int64) * stride)
            sizes.append(np.full(len(blocks), layer.page_bytes, np.int64))
        lo = np.concatenate(los)
        order = np.argsort(lo, kind="stable")
        lo = lo[order]
        # How far the ranges so far reach: a range starting past it opens a
        # new span.
        reach = np.maximum.accumulate(lo + np.concatenate(sizes)[order])
        starts = np.flatnonzero(np.r_[True, lo[1:] > reach[:-1]])
        ends = np.r_[starts[1:], lo.size] - 1
        return [
            [lo_, hi_]
            for lo_, hi_ in zip(lo[starts].tolist(), reach[ends].tolist(), strict=True)
        ]

    def _snap_view(self, layer: LayerView) -> np.ndarray:
        """The snapshot's bytes of ``layer``: its ``u8`` geometry over the
        copy."""
        assert self._snap is not None
        return np.lib.stride_tricks.as_strided(
            self._snap[self.page_offset(layer, 0) :],
            shape=layer.u8.shape,
            strides=layer.u8.strides,
            writeable=True,
        )

    def stray_bytes(self, pages: Iterable[tuple[LayerView, int]]) -> np.ndarray:
        """Offsets of the bytes changed since ``snapshot`` outside ``pages``,
        ascending; the copy equals the buffer again afterwards (``snapshot``
        before the next call).

        When every layer's page is one range of bytes (``_dense``), the
        ranges between the pages are compared with ``memcmp`` and then the
        pages are copied; otherwise the pages are copied first (one strided
        copy per layer) and the whole buffer is compared. Either way only a
        region that differs is looked at byte by byte, and the result is the
        same as comparing every byte against a mask of the pages.
        """
        assert self._snap is not None, "stray_bytes before snapshot"
        cur, snap = self.bytes, self._snap
        if self._dense:
            # The same bytes compared, without copying the pages before:
            # the ranges between them, then the pages copied (one memcpy per
            # merged range) so the copy is the buffer again.
            spans = self._spans(pages)
            found = []
            at = 0
            for lo, hi in [*spans, [cur.size, cur.size]]:
                if lo > at:
                    found.append(at + _differing(cur[at:lo], snap[at:lo]))
                at = max(at, hi)
            for lo, hi in spans:
                snap[lo:hi] = cur[lo:hi]
            stray = np.concatenate(found) if found else np.empty(0, dtype=np.intp)
            snap[stray] = cur[stray]
            self._touched = {}
            return stray
        by_layer: dict[str, tuple[LayerView, list[int]]] = {}
        for layer, block in pages:
            by_layer.setdefault(layer.name, (layer, []))[1].append(block)
        for layer, blocks in by_layer.values():
            index = np.asarray(blocks, dtype=np.intp)
            self._snap_view(layer)[index] = layer.u8[index]
        stray = _differing(cur, snap)
        # The copy is the buffer again: the next snapshot starts from here.
        snap[stray] = cur[stray]
        self._touched = {}
        return stray

    def zero_blocks(self, blocks: Iterable[int]) -> None:
        """vLLM zeroes every layer's page of a freshly allocated block (the
        prefill leg uses its own byte: zeros it never wrote must not look
        like the decoder's)."""
        blocks = list(blocks)
        if not blocks:
            return
        for layer in self._distinct:
            layer.u8[blocks] = self.zero
            self.touch(layer, blocks)

    def copy_block(self, src: int, dst: int, group: int | None = None) -> None:
        for layer in self._distinct if group is None else self.layers_of(group):
            layer.u8[dst] = layer.u8[src]
            self.touch(layer, (dst,))

    def zero_page(self, layer: LayerView, block: int) -> None:
        layer.u8[block] = 0
        self.touch(layer, (block,))


def _dense(page: np.ndarray) -> bool:
    """Whether ``page``'s bytes fill one range of memory (in any order of
    its axes)."""
    step = page.itemsize
    for stride, n in sorted(zip(page.strides, page.shape, strict=True)):
        if n <= 1:
            continue
        if stride != step:
            return False
        step *= n
    return True


def _map_file(path: str, size: int) -> mmap.mmap:
    """The first ``size`` bytes of file ``path``, mapped shared with every
    page in place (``MAP_POPULATE``); the file is created, or grown, to hold
    them, and otherwise kept as it is.

    A rank's buffer and snapshot files outlive the rank: the next
    configuration's rank maps them again. On tmpfs, faulting in the pages of
    a fresh file or array one by one costs most of a large configuration's
    setup (a second per GiB on this kind of machine); mapping a file whose
    pages exist, populated at once, costs a tenth of that."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)


_memcmp = ctypes.CDLL(None).memcmp
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_memcmp.restype = ctypes.c_int


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one shape and dtype hold the same bytes:
    ``memcmp`` when both are contiguous."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.flags.c_contiguous and b.flags.c_contiguous:
        return bool(
            a.nbytes == 0 or _memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0
        )
    return bool(np.array_equal(a, b))


def _differing(cur: np.ndarray, snap: np.ndarray) -> np.ndarray:
    """Offsets where two contiguous byte arrays of one size differ,
    ascending: ``memcmp`` over the whole, then over chunks, then the
    differing 8-byte words of a differing chunk, then their bytes."""
    if same_bytes(cur, snap):
        return np.empty(0, dtype=np.intp)
    found = []
    for lo in range(0, cur.size, _CHUNK):
        a, b = cur[lo : lo + _CHUNK], snap[lo : lo + _CHUNK]
        if same_bytes(a, b):
            continue
        whole = a.size // 8 * 8
        words = np.flatnonzero(a[:whole].view(np.uint64) != b[:whole].view(np.uint64))
        offsets = (words[:, None] * 8 + np.arange(8)).reshape(-1)
        offsets = np.concatenate([offsets, np.arange(whole, a.size)])
        found.append(lo + offsets[a[offsets] != b[offsets]])
    return np.concatenate(found)
