"""Sweep: base and overlay side by side, each in its own processes.

Each variant's moriio package is materialized into a directory (base files
from the pinned wheel, overlay files from the patch stack) and loaded there
by ``worker.py``; layouts are split across processes to use both cores.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import msgspec

from vllm_overlay.checkout import Checkout
from vllm_overlay.series.pin import MODULE_DIR
from vllm_overlay.simulate import procs
from vllm_overlay.simulate.builds import BuildPair
from vllm_overlay.simulate.eta import SCHEDULER_CPU_PER_CASE
from vllm_overlay.simulate.faults import FaultReport
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.simulate.report import (
    LayoutReport,
    PlanItem,
    SweepReport,
    WorkerLine,
)
from vllm_overlay.simulate.worker import MARK
from vllm_overlay.text import count
from vllm_overlay.tree.materialize import BaseSource
from vllm_overlay.tree.variant import MORIIO_FILES

_DECODER = msgspec.json.Decoder(WorkerLine)

DEFAULT_LENGTHS = "1-4096/17"
FAMILY_LENGTHS = "1-4096/67"
"""Default for the model families: their real layer counts give up to ~50
groups, and a case costs the real scheduler's time per group and page."""
DEFAULT_HITS = "0,50,89.7,100"

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


def default_lengths(layout_names: list[str]) -> dict[str, str]:
    """Lengths per layout when none are given: every 17th for the mechanism
    layouts, every 67th for the model families."""
    from vllm_overlay.simulate.layouts import BASE_LAYOUTS

    return {
        name: DEFAULT_LENGTHS if name.split("/")[0] in BASE_LAYOUTS else FAMILY_LENGTHS
        for name in layout_names
    }


def _whole_number(value: str, part: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{part!r} is not a length, a range a-b or a range a-b/step"
        ) from None


def parse_lengths(text: str) -> list[int]:
    """``1-4096``, ``1-4096/13`` (every 13th), ``251,377`` or a mix. A bad
    value is a ValueError saying why."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        rng, _, step = part.partition("/")
        lo, _, hi = rng.partition("-")
        first = _whole_number(lo, part)
        last = _whole_number(hi or lo, part)
        every = _whole_number(step or "1", part)
        if first < 1:
            raise ValueError(f"a prompt length is at least 1, not {first}")
        if last < first:
            raise ValueError(f"a range a-b needs a <= b, not {first} > {last}")
        if every < 1:
            raise ValueError(f"a step is at least 1, not {every}")
        out.update(range(first, last + 1, every))
    if not out:
        raise ValueError("no length given (e.g. 1-4096, 1-4096/17 or 251,377)")
    return sorted(out)


def parse_hits(text: str) -> list[float]:
    """Percentages, e.g. ``0,50,89.7,100`` -> fractions. A bad value is a
    ValueError saying why."""
    hits = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            percent = float(part)
        except ValueError:
            raise ValueError(f"{part!r} is not a percentage") from None
        if not 0 <= percent <= 100:
            raise ValueError(f"a hit is 0 to 100 %, not {part}")
        hits.append(percent / 100)
    if not hits:
        raise ValueError("no hit given (e.g. 0,50,100)")
    return hits


def _by_name(texts: dict[str, str]) -> dict[str, str]:
    return {Path(path).name: text for path, text in texts.items()}


def base_files(
    source: BaseSource | None = None, checkout: Checkout | None = None
) -> tuple[dict[str, str], str]:
    """The pinned base moriio files (by file name), checked against the pin,
    and where they came from (see ``BaseSource``)."""
    checkout = checkout or Checkout.find()
    resolved = (source or BaseSource()).resolved()
    bases = resolved.load(checkout.pin, checkout.series)
    # Reports name the base by the pin its files were checked against, not
    # by a path on the machine that ran them (the README quotes them).
    vllm = checkout.pin.vllm
    origin = f"wheel {resolved.wheel.name}" if resolved.wheel else "installed package"
    return _by_name(bases.texts), f"vLLM {vllm.version} ({vllm.git_commit}, {origin})"


def overlay_files(
    base: dict[str, str], source: str | None = None, checkout: Checkout | None = None
) -> tuple[dict[str, str], str]:
    """Overlaid moriio files.

    ``source``: ``series`` (default: this checkout's patch series applied to
    ``base``), a directory holding the files, or ``REPO@REF`` (a patch-stack
    branch, e.g. ``/work/scratch/stack@p0003``).
    """
    if source is None or source == "series":
        from vllm_overlay.tree.apply import overlay_texts

        checkout = checkout or Checkout.find()
        pin, series = checkout.pin, checkout.series
        full = {path: base[Path(path).name] for path in pin.files}
        texts = dict(base)
        texts.update(_by_name(overlay_texts(full, series)))
        names = ", ".join(p.name.split("-")[0] for p in series.patches)
        return texts, f"series {series.series_id} ({names or 'empty'})"
    if Path(source).is_dir():
        d = Path(source)
        return {name: (d / name).read_text() for name in MORIIO_FILES}, str(d)
    repo_s, _, ref = source.partition("@")
    files = {
        name: subprocess.run(
            ["git", "-C", repo_s, "show", f"{ref}:{MODULE_DIR}/{name}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for name in MORIIO_FILES
    }
    commit = subprocess.run(
        ["git", "-C", repo_s, "rev-parse", "--short", ref],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return files, f"{repo_s}@{ref} ({commit})"


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
) -> SweepReport:
    """``variants``: pair names (``base``, ``overlay``, ``base->overlay``,
    ``overlay->base``; ``builds.py``); each pair runs in processes of its
    own. ``whole``: every case through the schedulers (``shrink.py``).
    ``faults``: run these fault modes (``faults.py``) instead of the sweep,
    each on every layout."""
    start = time.monotonic()
    options = options or procs.SweepOptions()
    names = [layout.name for layout in expand(layouts or None)]
    per_layout = (
        {name: lengths for name in names} if lengths else default_lengths(names)
    )
    for text in set(per_layout.values()):
        parse_lengths(text)
    parse_hits(hits)
    pairs = [BuildPair.parse(v) for v in variants]
    sources = options.sources(variants)
    modes: list[str | None] = list(faults) if faults else [None]
    items_per_pair = [
        PlanItem(name, per_layout[name], hits, whole, fault=fault)
        for name in names
        for fault in modes
    ]
    tally = procs.Tally(len(items_per_pair) * len(pairs), _key, options.progress)
    if processes_per_variant is None:
        # Each process pays ~20 s of imports: one per pair when several run.
        processes_per_variant = max(1, (os.cpu_count() or 2) // len(pairs))
    chunks = _split_items(items_per_pair, processes_per_variant)
    ports = {p.name: 20000 + 4000 * i for i, p in enumerate(pairs)}
    per_variant = sum(len(parse_lengths(item.lengths)) for item in items_per_pair)
    cases = per_variant * len(parse_hits(hits)) * len(pairs)
    what = "simulate --faults" if faults else "simulate"
    options.expect(
        what,
        f"{count(cases, 'case')}: {count(len(names), 'layout')} x "
        f"{count(len(pairs), 'variant')}"
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
        hits=[h * 100 for h in parse_hits(hits)],
        variants=options.where_pairs(sources, [p.name for p in pairs]),
        layouts=[r for r in results if isinstance(r, LayoutReport)],
        wall_seconds=time.monotonic() - start,
        faults=[r for r in results if isinstance(r, FaultReport)],
    )


def _key(line: PlanItem | LayoutReport | FaultReport) -> str:
    """What a plan item or a result is about: its layout (and fault)."""
    fault = getattr(line, "fault", None)
    return f"{line.layout} {fault}" if fault else str(line.layout)


def _split_items(items: list[PlanItem], parts: int) -> list[list[PlanItem]]:
    """``items`` over ``parts`` processes, balanced by each layout's cost."""
    by_name = {_key(item): item for item in items}
    return [[by_name[k] for k in chunk] for chunk in _split(list(by_name), parts)]
