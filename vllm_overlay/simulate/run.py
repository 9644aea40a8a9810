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
from vllm_overlay.simulate.eta import SCHEDULER_CPU_PER_CASE
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
    bases = (source or BaseSource()).load(checkout.pin, checkout.series)
    return _by_name(bases.texts), bases.source


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
    for name in sorted(layouts, key=lambda n: -_COST.get(n.split("/")[0], 1.0)):
        i = loads.index(min(loads))
        buckets[i].append(name)
        loads[i] += _COST.get(name.split("/")[0], 1.0)
    return [b for b in buckets if b]


def _start_worker(
    moriio_dir: Path, variant: str, plan: list[PlanItem], port: int
) -> subprocess.Popen[str]:
    args = [*procs.variant_args(moriio_dir, variant, plan), f"--port={port}"]
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
        lambda moriio_dir: _start_worker(moriio_dir, variant, plan, port),
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
) -> SweepReport:
    """``whole``: every case through the schedulers (``shrink.py``)."""
    start = time.monotonic()
    options = options or procs.SweepOptions()
    names = [layout.name for layout in expand(layouts or None)]
    per_layout = (
        {name: lengths for name in names} if lengths else default_lengths(names)
    )
    for text in set(per_layout.values()):
        parse_lengths(text)
    parse_hits(hits)
    sources = options.sources(variants)
    tally = procs.Tally(
        len(names) * len(sources), lambda r: str(r.layout), options.progress
    )
    if processes_per_variant is None:
        # Each process pays ~20 s of imports: one per variant when both run.
        processes_per_variant = max(1, (os.cpu_count() or 2) // len(sources))
    chunks = _split(names, processes_per_variant)
    ports = {v: 20000 + 4000 * i for i, v in enumerate(sources)}
    per_variant = sum(len(parse_lengths(per_layout[n])) for n in names)
    cases = per_variant * len(parse_hits(hits)) * len(sources)
    options.expect(
        "simulate",
        f"{count(cases, 'case')}: {count(len(names), 'layout')} x "
        f"{count(len(sources), 'variant')}",
        cases,
        SCHEDULER_CPU_PER_CASE,
        len(chunks) * len(sources),
    )

    def launch(variant: str, moriio_dir: Path) -> list[procs.Started]:
        return [
            (
                _start_worker(
                    moriio_dir,
                    variant,
                    [PlanItem(name, per_layout[name], hits, whole) for name in chunk],
                    ports[variant] + 2000 * i,
                ),
                f"simulator worker {variant} {chunk}",
            )
            for i, chunk in enumerate(chunks)
        ]

    procs.run_processes(sources, launch, MARK, _DECODER, tally)
    order = {name: i for i, name in enumerate(names)}
    results = tally.ordered(lambda r: order.get(r.layout, 0), list(sources))
    return SweepReport(
        lengths=", ".join(sorted(set(per_layout.values()))),
        hits=[h * 100 for h in parse_hits(hits)],
        variants=options.where(sources),
        layouts=results,
        wall_seconds=time.monotonic() - start,
    )
