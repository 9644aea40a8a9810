"""One simulator process: one moriio variant, some layouts.

Run as ``python -m vllm_overlay.simulate.worker`` by ``run.py``. Writes one
``Progress`` / ``LayoutReport`` per line to stdout, each prefixed with
``MARK`` (vLLM may print its own lines too).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import msgspec

from vllm_overlay.simulate import shrink
from vllm_overlay.simulate.drive import Pair
from vllm_overlay.simulate.faults import FAULTS, FaultReport
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.simulate.lines import Progress
from vllm_overlay.simulate.plan import PlanItem
from vllm_overlay.simulate.procs import Emitter, load_variant, variant_parser
from vllm_overlay.simulate.report import LayoutReport
from vllm_overlay.simulate.writes import READ, Mode, row_key

MARK = "@@simulate "
emit = Emitter(MARK)


def refusal_origin(exc: BaseException) -> str:
    """``connector`` when the innermost frame raising is the MoRIIO module's,
    else ``vllm`` (config validation, the planner, the KV cache manager)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and f"{os.sep}moriio{os.sep}" in frames[-1].filename:
        return "connector"
    return "vllm"


def run_layout(
    variant: str,
    layout_name: str,
    lengths: Sequence[int],
    hits: Sequence[float],
    port: int,
    progress_every: int = 200,
    whole: bool = False,
    mode: Mode = READ,
) -> LayoutReport:
    """``whole``: run every case through the schedulers; otherwise most
    follow from small ones (``shrink.py``). ``mode``: the connector's, READ
    or WRITE (``drive.py``)."""
    layout = expand([layout_name])[0]
    report = LayoutReport(
        variant=variant,
        layout=layout.name,
        note=layout.note,
        family=layout.family,
        source=layout.source,
        mode=mode,
    )
    what = row_key(layout.name, mode)
    start = time.monotonic()
    try:
        pair = Pair(layout, max(lengths) + 64, port=port, mode=mode)
    except Exception as exc:  # the connector or vLLM refuses this layout
        report.refused_at_start = " ".join(f"{type(exc).__name__}: {exc}".split())
        report.refused_by = refusal_origin(exc)
        report.seconds = time.monotonic() - start
        return report
    report.lengths_tried = len(lengths)
    total = len(lengths) * len(hits)
    stats = shrink.Stats()

    def run(n: int, held: int, hit: float) -> Any:
        stats.run += 1
        if stats.run % progress_every == 0:
            emit(Progress(variant, what, min(stats.cases, total), total))
        return pair.run_case(n, hit, held=held)

    period = None if whole else shrink.layout_period(pair)
    measured = 0
    if period is not None and shrink.may_shrink(period, lengths, hits):
        # Probe cases are not cases of the sweep: not counted, not reported.
        measured = shrink.calibrate(lambda n: pair.run_case(n, 0.0), max(lengths))
    run_cost = measured or shrink.RUN_COST
    for result in shrink.sweep(period, lengths, hits, run, stats, run_cost):
        report.add(result)
    report.cases_run = stats.run
    report.period = period.period if period else 0
    report.run_cost = measured
    report.finish()
    report.seconds = time.monotonic() - start
    return report


def run_faults(
    variant: str,
    layout_name: str,
    fault_name: str,
    lengths: Sequence[int],
    hits: Sequence[float],
    port: int,
) -> FaultReport:
    """Every (length, hit) case of one fault mode on one layout."""
    fault = FAULTS[fault_name]
    layout = expand([layout_name])[0]
    report = FaultReport(variant, layout.name, fault.name, fault.covers)
    start = time.monotonic()
    try:
        pair = Pair(layout, max(lengths) + 64, port=port)
    except Exception as exc:  # the connector or vLLM refuses this layout
        report.refused_at_start = " ".join(f"{type(exc).__name__}: {exc}".split())
        report.seconds = time.monotonic() - start
        return report
    total = len(lengths) * len(hits)
    for i, (hit, n) in enumerate((h, n) for h in hits for n in lengths):
        report.add(pair.run_fault_case(n, hit, fault))
        emit(Progress(variant, f"{layout.name} {fault.name}", i + 1, total))
    report.seconds = time.monotonic() - start
    return report


def main(argv: list[str] | None = None) -> int:
    ap = variant_parser()
    ap.add_argument("--port", type=int, default=40000)
    args = ap.parse_args(argv)

    pair = load_variant(args)
    plan = msgspec.json.decode(args.plan, type=list[PlanItem])
    for i, item in enumerate(plan):
        if item.pair is not None and item.pair != pair:
            raise SystemExit(
                f"plan item {item.layout}: pair {item.pair.name}, "
                f"this process runs {pair.name}"
            )
        port = args.port + 1000 * i
        lengths, hits = item.lengths, item.hits
        if item.fault is not None:
            emit(run_faults(args.variant, item.layout, item.fault, lengths, hits, port))
            continue
        emit(
            run_layout(
                args.variant,
                item.layout,
                lengths,
                hits,
                port=port,
                whole=item.whole,
                mode=item.mode,
            )
        )
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # vLLM's exit handlers take seconds and add nothing here.
    os._exit(code)
