"""Sweep: base and overlay side by side, each variant's plan handed to its
zygote processes as they finish (``dispatch.py``; ``ZYGOTES`` at a time by
default).

Each variant's moriio package is materialized into a directory (as in the
scheduler simulator, ``simulate/run.py``); its zygote runs with the ``mori``
stand-in (``standin/``) first on ``PYTHONPATH``, the only place it is ever
importable as ``mori``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Literal

import msgspec

from vllm_overlay.simulate import procs
from vllm_overlay.simulate.builds import BuildPair
from vllm_overlay.simulate.bytes.dispatch import Dispatcher, variant_orders
from vllm_overlay.simulate.bytes.ports import port_ranges
from vllm_overlay.simulate.bytes.report import (
    MARK,
    BytesReport,
    ConfigItem,
    ConfigReport,
    ZygoteLine,
    config_name,
)
from vllm_overlay.simulate.bytes.shm import remove_stale_shm
from vllm_overlay.simulate.eta import BYTES_CPU_PER_CASE
from vllm_overlay.simulate.layouts import all_layouts
from vllm_overlay.simulate.plan import parse_hits, parse_lengths, where_pairs
from vllm_overlay.text import count
from vllm_overlay.warm import PARENT_ENV

STANDIN_DIR = Path(__file__).resolve().parent / "standin"

# Every residue class the scheduler-side bugs depend on: (N - 1) mod 16 and
# mod 64 below and above 55 (the lookahead shift at block 64), N against the
# windows (128, 512) and the 16-token tail ring, one and two pages.
DEFAULT_LENGTHS = "2,17,33,56,64,65,100,120,129,192,250,257,300,513,530,700"
DEFAULT_HITS = "0,50,100"
DEFAULT_FAMILY_LENGTHS = "2,17,65,129,257,530"
"""A model family's default: its residue classes at fewer lengths (one and
two pages of 16, 64 and 256, past the 128-token windows and the 16-token
ring). Its every case moves the family's own geometry over all its layers,
tens to hundreds of times the bytes of a mechanism layout's."""
DEFAULT_FAMILY_TP_LENGTHS = "17,129,530"
"""A model family's lengths at its unequal TP pair: one page of 16 and two of
256, past the 128-token windows, one hit each (the TP mapping and head
slices are the same at every length)."""
MODES = ("read", "write")
TP_PAIRS = ((1, 1), (2, 2), (1, 2), (2, 1))
FAMILY_TP_PAIRS = ((1, 1),)
"""A model family's TP pairs at its own lengths by default: the mechanism
layouts cover every TP pair, and each configuration costs its own rank
processes."""
FAMILY_TP_SAMPLE = ((1, 2), (2, 1))
"""By default the ``i``-th model family layout also runs
``FAMILY_TP_SAMPLE[i % 2]`` at ``DEFAULT_FAMILY_TP_LENGTHS``
(``--family-tp all``: every family at every pair of ``TP_PAIRS``)."""
FamilyTP = Literal["sample", "all"]
FAMILY_TP_CHOICES: tuple[FamilyTP, ...] = ("sample", "all")
KV_LAYOUTS = ("LBNHC", "BLNHC")
_NO_GQA_LAYOUTS = frozenset({"kimi"})
"""Layouts without a GQA layer: the KV heads change none of their bytes, and
they keep the default's. GLM's kpool tail ring is laid out as a GQA layer: at
unequal-TP READ it runs with one KV head, as ``Glm5NextTailCache`` declares
it (``layouts._tail_ring``), replicated on every rank."""
ZYGOTES = 1
"""Zygotes per variant at a time by default (``--processes``), each on its
own ports (``ports.port_ranges``) and /dev/shm files. More than one helps
only with idle cores: on two shared cores, two per variant (up to 16 rank
processes at once) took as long and 14 % more CPU, and one extra zygote over
both variants 25 % longer."""


MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
}
"""glibc's heap for the zygotes and their ranks: arrays up to 32 MiB (a
layer's rows, a judge's expected bytes) come from the heap and their memory
stays there for the next, instead of a fresh mapping faulted in page by
page each time. On a family and a mechanism sample: 11-12 % less time per
configuration, the same reports."""


def plan_items(
    layouts: list[str],
    modes: list[str],
    tp_pairs: list[tuple[int, int]] | None,
    kv_layouts: list[str],
    family_lengths: str | None = None,
    all_hits: bool = False,
    family_tp: FamilyTP = "sample",
    sample_lengths: str | None = None,
) -> list[ConfigItem]:
    """Every combination. READ with unequal TP needs replicated KV heads
    (``validate_moriio_heterogeneous_tp_kv_heads``), so its GQA layers run
    with one KV head; MLA latents are replicated anyway. A model family's
    layout fixes its KV cache layout (its grouping depends on it: the
    matrix's ``-BLNHC`` rows), so it runs only in that one. ``tp_pairs``
    None: ``TP_PAIRS`` for mechanism layouts; for families,
    ``FAMILY_TP_PAIRS`` and the family's unequal pair of
    ``FAMILY_TP_SAMPLE`` at ``sample_lengths`` (``family_tp`` "sample"), or
    ``TP_PAIRS`` ("all"). ``family_lengths``: a model family's prompt
    lengths, when they are not the sweep's.

    Every configuration runs every prompt length (every residue class). A
    mechanism layout at TP 1->1 or with DCP runs each length at every
    decoder prefix hit; unless ``all_hits``, the other configurations (the
    other TP pairs, the model families with or without DCP) run each length
    at one hit, in turn, from an offset that differs between their TP pairs (a family's:
    between its modes), so that together they still run every (length,
    hit) case. The hit changes which pages the decoder lacks, which the
    TP 1->1 configurations cover at every length; the geometry the other
    TP pairs and the families add is the same at every hit."""
    known = all_layouts()
    families = [key for key, layout in known.items() if layout.family]
    items = []
    for name in layouts:
        key, _, dcp = name.partition("/dcp")
        if key not in known:
            raise ValueError(f"unknown layout {name!r}; known: {', '.join(known)}")
        layout = known[key]
        own = [layout.kv_cache_layout] if layout.family else kv_layouts
        pairs = tp_pairs or TP_PAIRS
        sampled = None
        if layout.family and not tp_pairs and family_tp == "sample":
            sampled = FAMILY_TP_SAMPLE[families.index(key) % len(FAMILY_TP_SAMPLE)]
            pairs = [*FAMILY_TP_PAIRS, sampled]
        size = int(dcp or 1)
        if size > 1:
            # DCP ranks are TP ranks: each leg runs TP = DCP, and the GQA
            # layers replicate their one KV head over the DCP group.
            pairs = [(size, size)] if tp_pairs is None else tp_pairs
            if any(pair != (size, size) for pair in pairs):
                raise ValueError(
                    f"{name}: the byte-level simulation runs decode context "
                    f"parallelism {size} with TP {size}->{size} only"
                )
        rotated = [pair for pair in pairs if pair != (1, 1)]
        for mode in modes:
            for p_tp, d_tp in pairs:
                heads = 1 if (mode == "read" and p_tp != d_tp) or size > 1 else 4
                if key in _NO_GQA_LAYOUTS:
                    heads = 4
                offset = None
                if not all_hits and layout.family:
                    offset = MODES.index(mode)
                elif not all_hits and size == 1 and (p_tp, d_tp) != (1, 1):
                    offset = rotated.index((p_tp, d_tp))
                lengths = family_lengths if layout.family else None
                if (p_tp, d_tp) == sampled:
                    lengths = sample_lengths
                for kv_layout in own:
                    if kv_layout in kv_layouts:
                        items.append(
                            ConfigItem(
                                name,
                                mode,
                                p_tp,
                                d_tp,
                                kv_layout,
                                heads,
                                lengths=lengths,
                                hit_offset=offset,
                            )
                        )
    return items


def _family(item: ConfigItem, families: set[str]) -> bool:
    return item.layout.partition("/")[0] in families


def parse_tp_pairs(text: str) -> list[tuple[int, int]]:
    """``1-1,2-2,1-2,2-1`` (prefill-decode)."""
    pairs = []
    for part in text.split(","):
        p, _, d = part.strip().partition("-")
        pair = (int(p), int(d or p))
        if min(pair) < 1:
            raise ValueError(f"TP sizes must be positive: {part!r}")
        pairs.append(pair)
    return pairs


_DECODER = msgspec.json.Decoder(ZygoteLine)


def _start_zygote(
    dirs: dict[str, Path],
    variant: str,
    plan: list[ConfigItem] | None,
    lengths: str,
    hits: str,
    ports: tuple[int, int] | None = None,
    write_wait: float | None = None,
) -> subprocess.Popen[str]:
    """``plan`` None: the zygote reads its configurations from stdin;
    ``write_wait`` None: the driver's ``WRITE_WAIT``."""
    args = [
        *procs.build_args(dirs),
        f"--variant={variant}",
        "--plan=" + ("-" if plan is None else msgspec.json.encode(plan).decode()),
        f"--lengths={lengths}",
        f"--hits={hits}",
    ]
    if ports is not None:
        args.append(f"--ports={ports[0]}-{ports[1]}")
    if write_wait is not None:
        args.append(f"--write-wait={write_wait}")
    # MoRIIO's KDA transfer needs the dim-first conv state layout. The
    # zygote ends with this process (lifetime.py).
    env = {
        "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
        PARENT_ENV: str(os.getpid()),
        **MALLOC_ENV,
    }
    return procs.start(
        "vllm_overlay.simulate.bytes.zygote",
        args,
        [STANDIN_DIR],
        env,
        stdin=subprocess.PIPE if plan is None else None,
    )


def run_zygote(
    variant: str,
    files: dict[str, str] | None,
    items: list[ConfigItem],
    lengths: str,
    hits: str,
    write_wait: float | None = None,
) -> list[ConfigReport]:
    """One variant's plan in one zygote; ``files`` None runs the installed
    moriio package; ``write_wait``: seconds a promised WRITE is waited for
    (None: the driver's ``WRITE_WAIT``)."""
    return procs.run_variant_process(
        variant,
        files,
        lambda dirs: _start_zygote(
            dirs, variant, items, lengths, hits, write_wait=write_wait
        ),
        MARK,
        _DECODER,
    )


class ZygoteSession:
    """One variant's zygote kept for plan after plan (``--plan -``), so that
    a test session's byte-level tests import vLLM once: each plan's
    configurations run after the previous plan's in the same zygote, as a
    sweep's do. A zygote that ends (a plan crashed it) fails its plan with
    its last lines; the next plan starts a fresh one. ``files`` None: the
    installed moriio package."""

    def __init__(self, variant: str, files: dict[str, str] | None = None) -> None:
        self.variant = variant
        self.started = 0
        self._files = files
        self._stack = contextlib.ExitStack()
        self._dirs: dict[str, Path] | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._tail: list[str] = []

    def __enter__(self) -> ZygoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the zygote's stdin (it ends once idle), stop it if it does
        not, and remove its moriio directory."""
        proc, self._proc = self._proc, None
        if proc is not None:
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(procs.STOP_GRACE)
            except subprocess.TimeoutExpired:
                procs.stop([proc])
            if proc.stdout is not None:
                proc.stdout.close()
        self._stack.close()
        self._dirs = None

    def _zygote(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:  # ended: its pipes go
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        if self._dirs is None:
            self._dirs = self._stack.enter_context(
                procs.variant_dirs({self.variant: (self._files, "")})
            )
        # Its own lengths and hits are never used: every item carries them.
        self._proc = _start_zygote(
            procs.pair_dirs(self.variant, self._dirs), self.variant, None, "1", "0"
        )
        self._tail = []
        self.started += 1
        return self._proc

    def run(
        self,
        items: list[ConfigItem],
        lengths: str,
        hits: str,
        write_wait: float | None = None,
    ) -> list[ConfigReport]:
        """As ``run_zygote`` (each report's ``item`` is the one given), in
        this session's zygote."""
        proc = self._zygote()
        assert proc.stdin is not None and proc.stdout is not None
        for item in items:
            planned = msgspec.structs.replace(
                item,
                lengths=item.lengths or lengths,
                hits=item.hits or hits,
                write_wait=write_wait if item.write_wait is None else item.write_wait,
            )
            proc.stdin.write(msgspec.json.encode(planned).decode() + "\n")
        proc.stdin.flush()
        reports: list[ConfigReport] = []
        while len(reports) < len(items):
            line = proc.stdout.readline()
            if not line:
                code = proc.wait()
                raise RuntimeError(
                    f"simulator process ({self.variant}) exited {code}:\n"
                    + "".join(self._tail)
                )
            if not line.startswith(MARK):
                self._tail = [*self._tail[-29:], line]
                continue
            result = _DECODER.decode(line[len(MARK) :])
            if isinstance(result, ConfigReport):
                result.item = items[len(reports)]
                reports.append(result)
        return reports


def run_bytes_sweep(
    items: list[ConfigItem],
    lengths: str,
    hits: str,
    variants: list[str],
    options: procs.SweepOptions | None = None,
    zygotes: int = ZYGOTES,
) -> BytesReport:
    """Every item on every pair of builds (``variants``: ``base``,
    ``overlay``, ``base->overlay``...; a mixed pair runs the mechanism
    layouts only), ``zygotes`` processes per pair at a time
    (``dispatch.py``); the report lists the items in plan order whichever
    process ran them."""
    start = time.monotonic()
    options = options or procs.SweepOptions()
    lengths_list = parse_lengths(lengths)
    hits_list = parse_hits(hits)
    sources = options.sources(variants)
    families = {name for name, layout in all_layouts().items() if layout.family}
    per_pair = {
        v: [
            item
            for item in items
            if not (BuildPair.parse(v).mixed and _family(item, families))
        ]
        for v in variants
    }
    tally = procs.Tally(
        sum(map(len, per_pair.values())),
        lambda r: config_name(r.item),
        options.progress,
    )
    shares = max(1, min(zygotes, len(items)))
    cases = sum(
        len(
            item.cases(
                lengths_list if item.lengths is None else parse_lengths(item.lengths),
                hits_list,
            )
        )
        for mine in per_pair.values()
        for item in mine
    )
    configs = sum(map(len, per_pair.values()))
    options.expect(
        "simulate-bytes",
        f"{count(configs, 'configuration')}, {count(cases, 'case')}",
        cases,
        BYTES_CPU_PER_CASE,
        shares * len(variants),
    )

    # A zygote stopped by a signal removes its ranks' /dev/shm files; one
    # killed outright cannot: whatever is left of a process that is gone
    # goes now (a previous run's) and once the zygotes are gone (this one's).
    remove_stale_shm()
    try:
        with procs.variant_dirs(sources) as dirs:
            orders = {
                v: variant_orders(per_pair[v], families, list(variants))[v]
                for v in variants
            }
            dispatcher = Dispatcher(
                orders,
                lambda variant, ports: _start_zygote(
                    procs.pair_dirs(variant, dirs), variant, None, lengths, hits, ports
                ),
                port_ranges(len(variants) * shares),
                shares,
                tally,
                MARK,
                _DECODER,
            )
            dispatcher.run()
    finally:
        remove_stale_shm()
    index = {item: i for i, item in enumerate(items)}
    results = tally.ordered(lambda r: index.get(r.item, 0), list(variants))
    # A family's own lengths, not those of its sampled unequal TP pair.
    own = {item.lengths for item in items if item.lengths is not None}
    own = {x for x in own if x != DEFAULT_FAMILY_TP_LENGTHS} or own
    return BytesReport(
        lengths=lengths_list,
        family_lengths=parse_lengths(own.pop()) if len(own) == 1 else None,
        hits=[h * 100 for h in hits_list],
        variants=where_pairs(sources, variants),
        configs=results,
        wall_seconds=time.monotonic() - start,
        zygotes={v: dispatcher.started.count(v) for v in variants},
    )
