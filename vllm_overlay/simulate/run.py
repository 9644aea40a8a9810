"""Sweep: base and overlay side by side, each in its own processes.

Each variant's moriio package is materialized into a directory (base files
from the pinned wheel, overlay files from the patch stack) and loaded there
by ``worker.py``; layouts are split across processes to use both cores.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from vllm_overlay.simulate import procs
from vllm_overlay.simulate.builds import BuildPair
from vllm_overlay.simulate.eta import SCHEDULER_CPU_PER_CASE
from vllm_overlay.simulate.faults import FaultReport
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.simulate.plan import (
    PlanItem,
    default_lengths,
    parse_hits,
    parse_lengths,
    where_pairs,
)
from vllm_overlay.simulate.report import LayoutReport, SweepReport, WorkerLine
from vllm_overlay.simulate.worker import MARK
from vllm_overlay.simulate.writes import READ, Mode, row_key
from vllm_overlay.text import count

_DECODER = msgspec.json.Decoder(WorkerLine)

# Relative cost per case, to balance layouts across processes.
_COST = {
    "llama": 1.0,
    "gemma": 2.0,
    "dsv4": 0.6,
    "kimi": 1.0,
    "glm": 1.2,
    "gemma3": 4.0,
    "inkling": 4.0,
    "qwen3.5-eagle3": 6.0,
    "deepseek-v4-pro-BLNHC": 4.0,
    "deepseek-v4-pro-mtp-BLNHC": 4.0,
}


def _split(layouts: list[str], parts: int) -> list[list[str]]:
    buckets: list[list[str]] = [[] for _ in range(parts)]
    loads = [0.0] * parts

    def cost(name: str) -> float:
        return _COST.get(name.split()[0].split("/")[0], 1.0)

    for name in sorted(layouts, key=lambda n: -cost(n)):
        i = loads.index(min(loads))
        buckets[i].append(name)
        loads[i] += cost(name)
    return [b for b in buckets if b]


def _start_worker(
    dirs: dict[str, Path], variant: str, plan: list[PlanItem], port: int
) -> subprocess.Popen[str]:
    args = [*procs.variant_args(dirs, variant, plan), f"--port={port}"]
    return procs.start("vllm_overlay.simulate.worker", args)


def run_variant(
    variant: str,
    files: dict[str, str],
    plan: list[PlanItem],
    port: int = 30000,
) -> list[LayoutReport]:
    """Run one plan in one worker process whose moriio files are ``files``."""
    return procs.run_variant_process(
        variant,
        files,
        lambda dirs: _start_worker(dirs, variant, plan, port),
        MARK,
        _DECODER,
    )


def run_sweep(
    layouts: list[str],
    lengths: str | None,
    hits: str,
    variants: list[str],
    options: procs.SweepOptions | None = None,
    processes_per_variant: int | None = None,
    whole: bool = False,
    faults: list[str] | None = None,
    modes: Sequence[Mode] = (READ,),
) -> SweepReport:
    """``variants``: pair names (``base``, ``overlay``, ``base->overlay``,
    ``overlay->base``; ``builds.py``); each pair runs in processes of its
    own. ``whole``: every case through the schedulers (``shrink.py``).
    ``faults``: run these fault modes (``faults.py``) instead of the sweep,
    each on every layout (READ). ``modes``: the connector's modes each
    layout runs in (``writes.py``), a row each."""
    start = time.monotonic()
    options = options or procs.SweepOptions()
    names = [layout.name for layout in expand(layouts or None)]
    per_layout = (
        {name: lengths for name in names} if lengths else default_lengths(names)
    )
    parsed = {text: tuple(parse_lengths(text)) for text in set(per_layout.values())}
    hit_values = tuple(parse_hits(hits))
    pairs = [BuildPair.parse(v) for v in variants]
    sources = options.sources(variants)
    fault_modes: list[str | None] = list(faults) if faults else [None]
    connector_modes: Sequence[Mode] = (READ,) if faults else modes
    items_per_pair = [
        PlanItem(
            name, parsed[per_layout[name]], hit_values, whole, fault=fault, mode=mode
        )
        for name in names
        for mode in connector_modes
        for fault in fault_modes
    ]
    tally = procs.Tally(len(items_per_pair) * len(pairs), _key, options.progress)
    if processes_per_variant is None:
        # Each process pays ~20 s of imports: one per pair when several run.
        processes_per_variant = max(1, (os.cpu_count() or 2) // len(pairs))
    chunks = _split_items(items_per_pair, processes_per_variant)
    ports = {p.name: 20000 + 4000 * i for i, p in enumerate(pairs)}
    per_variant = sum(len(item.lengths) for item in items_per_pair)
    cases = per_variant * len(hit_values) * len(pairs)
    what = "simulate --faults" if faults else "simulate"
    options.expect(
        what,
        f"{count(cases, 'case')}: {count(len(names), 'layout')} x "
        f"{count(len(pairs), 'variant')}"
        + (
            f" x {count(len(connector_modes), 'mode')}"
            if len(connector_modes) > 1
            else ""
        )
        + (f" x {count(len(faults), 'fault')}" if faults else ""),
        cases,
        SCHEDULER_CPU_PER_CASE * (2 if faults else 1),
        len(chunks) * len(pairs),
    )

    def launch(variant: str, dirs: dict[str, Path]) -> list[procs.Started]:
        pair = BuildPair.parse(variant)
        return [
            (
                _start_worker(
                    dirs,
                    variant,
                    [msgspec.structs.replace(item, pair=pair) for item in chunk],
                    ports[variant] + 2000 * i,
                ),
                f"simulator worker {variant} {[_key(item) for item in chunk]}",
            )
            for i, chunk in enumerate(chunks)
        ]

    procs.run_processes(sources, launch, MARK, _DECODER, tally, [p.name for p in pairs])
    order = {_key(item): i for i, item in enumerate(items_per_pair)}
    results = tally.ordered(lambda r: order.get(_key(r), 0), [p.name for p in pairs])
    return SweepReport(
        lengths=", ".join(sorted(set(per_layout.values()))),
        hits=[h * 100 for h in hit_values],
        variants=where_pairs(sources, [p.name for p in pairs]),
        layouts=[r for r in results if isinstance(r, LayoutReport)],
        wall_seconds=time.monotonic() - start,
        faults=[r for r in results if isinstance(r, FaultReport)],
    )


def _key(line: PlanItem | LayoutReport | FaultReport) -> str:
    """What a plan item or a result is about: its layout (and fault, or
    the connector's mode when WRITE)."""
    fault = getattr(line, "fault", None)
    if fault:
        return f"{line.layout} {fault}"
    return row_key(line.layout, getattr(line, "mode", READ))


def _split_items(items: list[PlanItem], parts: int) -> list[list[PlanItem]]:
    """``items`` over ``parts`` processes, balanced by each layout's cost."""
    by_name = {_key(item): item for item in items}
    return [[by_name[k] for k in chunk] for chunk in _split(list(by_name), parts)]
