"""What the MoRIIO connector costs the scheduler, per request and hook, base
vs overlay. A figure, not a test: nothing is asserted.

The simulator's prefill/decode pair (two real vLLM schedulers, the MoRIIO
connector in READ mode, layouts grouped by vLLM's planner) runs prompts of
4K..128K tokens; every call of the connector's scheduler-side hooks is timed
on both legs: ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta`` and ``request_finished`` (or
``request_finished_all_groups``, the hybrid form). A request's figure is the
sum of its calls on one leg (a decoder warm-up that gives the prefix hit is
not counted). Each variant runs in processes of its own
(``vllm_overlay.tree.variant``), base and overlay taking turns (ABBA...);
medians and spreads are over the repeats of every round. Times are the
calling thread's CPU time (on a shared machine wall time also counts other
processes' turns), with the cyclic garbage collector paused while a case is
timed (a collection lands on whichever hook happens to allocate). Growth is
the log-log slope of the median against the blocks a request holds (1.0 is
linear).

Usage: python benchmarks/hook_cost.py [--layouts L,..] [--lengths N,..]
       [--hits PCT,..] [--repeats R] [--rounds N]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from vllm_overlay import cpuplatform

LAYOUTS = "llama,dsv4,kimi/dcp8,glm"
LENGTHS = "4096,8192,16384,32768,65536,131072"
HITS = "0,50"
REPEATS = 4
ROUNDS = 2
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
)
_TIMED = {**{h: h for h in HOOKS}, "request_finished_all_groups": "request_finished"}
MARK = "@@hook-cost "


class Sample(msgspec.Struct, frozen=True, tag="sample"):
    layout: str
    n: int
    hit: float
    blocks: int
    """Blocks one request of ``n`` tokens holds, over all KV cache groups."""
    leg: str
    hook: str
    seconds: list[float]
    """One per repeat: the request's summed calls on this leg."""


class Refused(msgspec.Struct, frozen=True, tag="refused"):
    layout: str
    reason: str


Line = Sample | Refused


# -- worker: one variant, timed hooks ----------------------------------------


class _Clock:
    """Accumulates hook time per (leg, hook) while a case is being timed."""

    def __init__(self) -> None:
        self.legs: dict[int, str] = {}
        self.on = False
        self.totals: dict[tuple[str, str], float] = defaultdict(float)

    def wrap(self, cls: type, name: str) -> None:
        inner = getattr(cls, name)
        hook = _TIMED[name]
        clock = self

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return inner(self, *args, **kwargs)
            finally:
                if clock.on:
                    leg = clock.legs.get(id(self), "?")
                    clock.totals[(leg, hook)] += time.thread_time() - start

        setattr(cls, name, timed)


def _blocks(pair: Any, n: int) -> int:
    return sum(-(-n // g.block_tokens) for g in pair.groups)


def _measure(
    layout_name: str, lengths: list[int], hits: list[float], repeats: int
) -> Iterator[Line]:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector,
    )

    from vllm_overlay.simulate.drive import Pair
    from vllm_overlay.simulate.layouts import expand

    clock = _Clock()
    for name in _TIMED:
        clock.wrap(moriio_connector.MoRIIOConnector, name)
    layout = expand([layout_name])[0]
    try:
        pair = Pair(layout, max(lengths) + 64, port=38000)
    except Exception as exc:  # the connector or vLLM refuses the layout
        yield Refused(layout_name, " ".join(f"{type(exc).__name__}: {exc}".split()))
        return

    run_local = pair._run_local

    def untimed_warm_up(*args: Any) -> None:
        was, clock.on = clock.on, False
        try:
            run_local(*args)
        finally:
            clock.on = was

    pair._run_local = untimed_warm_up  # type: ignore[method-assign,assignment]
    for hit in hits:
        for n in lengths:
            runs: dict[tuple[str, str], list[float]] = defaultdict(list)
            pair.run_case(n, hit)  # warm: first-use costs are not the hook's
            for _ in range(repeats):
                # The pair rebuilds its legs after a failed case: map again.
                clock.legs = {
                    id(pair.p.scheduler.connector): "P",
                    id(pair.d.scheduler.connector): "D",
                }
                clock.totals.clear()
                gc.collect()
                gc.disable()
                clock.on = True
                try:
                    result = pair.run_case(n, hit)
                finally:
                    clock.on = False
                    gc.enable()
                if result.error is not None:
                    yield Refused(layout_name, f"{n} tokens: {result.error}")
                    return
                for leg in "PD":
                    for hook in HOOKS:
                        runs[(leg, hook)].append(clock.totals.get((leg, hook), 0.0))
            for (leg, hook), seconds in runs.items():
                yield Sample(layout_name, n, hit, _blocks(pair, n), leg, hook, seconds)


def worker(args: argparse.Namespace) -> int:
    from vllm_overlay.tree.variant import use_moriio_dir

    use_moriio_dir(args.moriio_dir)
    lengths = [int(x) for x in args.lengths.split(",")]
    hits = [float(x) / 100 for x in args.hits.split(",")]
    encoder = msgspec.json.Encoder()
    for layout in args.layouts.split(","):
        for line in _measure(layout, lengths, hits, args.repeats):
            sys.stdout.write(MARK + encoder.encode(line).decode() + "\n")
            sys.stdout.flush()
    return 0


# -- driver: both variants, the table -----------------------------------------


def _run_variant(
    variant: str, files: dict[str, str] | None, args: argparse.Namespace, root: Path
) -> list[Line]:
    from vllm_overlay.tree.variant import build_variant_dir

    moriio_dir = build_variant_dir(root / variant / "moriio", files)
    env = dict(
        cpuplatform.cpu_environ(),
        VLLM_LOGGING_LEVEL="ERROR",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        # The simulator's model config says 64K positions; the scheduler and
        # the connector never look at the model, only at max_model_len.
        VLLM_ALLOW_LONG_MAX_MODEL_LEN="1",
        PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    )
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        f"--moriio-dir={moriio_dir}",
        f"--layouts={args.layouts}",
        f"--lengths={args.lengths}",
        f"--hits={args.hits}",
        f"--repeats={args.repeats}",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    decoder = msgspec.json.Decoder(Line)
    lines: list[Line] = []
    tail: list[str] = []
    assert proc.stdout is not None
    for raw in proc.stdout:
        if raw.startswith(MARK):
            line = decoder.decode(raw[len(MARK) :])
            lines.append(line)
            if isinstance(line, Sample) and line.hook == HOOKS[0] and line.leg == "P":
                print(f"  {variant}: {line.layout} {line.n} tokens, hit {line.hit:g}")
        else:
            tail = [*tail[-20:], raw]
    if proc.wait() != 0:
        raise RuntimeError(
            f"{variant} worker exited {proc.returncode}:\n{''.join(tail)}"
        )
    return lines


def pooled(lines: list[Line]) -> list[Line]:
    """One sample per point, its runs from every round; each refusal once."""
    samples: dict[tuple[str, int, float, str, str], Sample] = {}
    refused: dict[tuple[str, str], Refused] = {}
    for line in lines:
        if isinstance(line, Refused):
            refused.setdefault((line.layout, line.reason), line)
            continue
        key = (line.layout, line.n, line.hit, line.leg, line.hook)
        if key in samples:
            seconds = [*samples[key].seconds, *line.seconds]
            line = msgspec.structs.replace(samples[key], seconds=seconds)
        samples[key] = line
    return [*refused.values(), *samples.values()]


def _median_us(s: Sample) -> float:
    return statistics.median(s.seconds) * 1e6


def _spread(s: Sample) -> str:
    """Interquartile range over the median, in percent."""
    if len(s.seconds) < 2:
        return "-"
    q = statistics.quantiles(s.seconds, n=4)
    med = statistics.median(s.seconds)
    return f"{100 * (q[2] - q[0]) / med:.0f}%" if med else "-"


def _slope(points: list[tuple[int, float]]) -> str:
    """Log-log slope of time against blocks between the ends (1.0: linear)."""
    (b0, t0), (b1, t1) = points[0], points[-1]
    if b1 == b0 or t0 <= 0 or t1 <= 0:
        return "-"
    return f"{math.log(t1 / t0) / math.log(b1 / b0):.2f}"


def table(lines: dict[str, list[Line]]) -> tuple[str, list[float]]:
    """The hook-cost table and every overlay/base median ratio in it."""
    samples: dict[tuple[str, str, float, str, str, int], Sample] = {}
    refused: dict[tuple[str, str], str] = {}
    for variant, vlines in lines.items():
        for line in vlines:
            if isinstance(line, Refused):
                refused[(variant, line.layout)] = line.reason
            else:
                key = (variant, line.layout, line.hit, line.leg, line.hook, line.n)
                samples[key] = line
    layouts = list(
        dict.fromkeys(k[1] for k in samples)
        | dict.fromkeys(layout for _, layout in refused)
    )
    out: list[str] = []
    ratios: list[float] = []
    for layout in layouts:
        for variant in lines:
            if (variant, layout) in refused:
                out.append(
                    f"{layout} {variant}: refused: {refused[(variant, layout)][:120]}"
                )
        keys = [k for k in samples if k[1] == layout and k[0] == "overlay"]
        hits = sorted({k[2] for k in keys})
        ns = sorted({k[5] for k in keys})
        for hit in hits:
            blocks = {
                n: samples[("overlay", layout, hit, "P", HOOKS[0], n)].blocks
                for n in ns
            }
            out.append("")
            out.append(
                f"{layout}, decoder prefix hit {hit * 100:g} %: median us per request, "
                "base -> overlay (overlay/base, overlay IQR/median)"
            )
            head = ["leg", "hook"] + [f"{n // 1024}K ({blocks[n]} blk)" for n in ns]
            head += ["growth b/o"]
            rows = [head]
            for leg in "PD":
                for hook in HOOKS:
                    row = [leg, hook]
                    ends: dict[str, list[tuple[int, float]]] = {
                        "base": [],
                        "overlay": [],
                    }
                    for n in ns:
                        o = samples.get(("overlay", layout, hit, leg, hook, n))
                        b = samples.get(("base", layout, hit, leg, hook, n))
                        if o is None:
                            row.append("-")
                            continue
                        om = _median_us(o)
                        ends["overlay"].append((o.blocks, om))
                        if b is None:  # the base refuses the layout
                            row.append(f"refused->{om:.0f} ({_spread(o)})")
                            continue
                        bm = _median_us(b)
                        ends["base"].append((b.blocks, bm))
                        ratio = om / bm if bm else float("nan")
                        if bm:
                            ratios.append(ratio)
                        row.append(f"{bm:.0f}->{om:.0f} (x{ratio:.2f}, {_spread(o)})")
                    row.append(
                        "/".join(
                            _slope(ends[v]) if len(ends[v]) > 1 else "-" for v in ends
                        )
                    )
                    rows.append(row)
            widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
            for i, row in enumerate(rows):
                out.append(
                    "  ".join(
                        c.ljust(w) for c, w in zip(row, widths, strict=True)
                    ).rstrip()
                )
                if i == 0:
                    out.append("  ".join("-" * w for w in widths))
    return "\n".join(out), ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=LAYOUTS)
    ap.add_argument("--lengths", default=LENGTHS)
    ap.add_argument("--hits", default=HITS, help="decoder prefix-hit percentages")
    ap.add_argument(
        "--repeats", type=int, default=REPEATS, help="timed runs per point and round"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="worker processes per variant, in the order base, overlay, overlay, "
        "base, ... so that a drift of the machine's load falls on both",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--moriio-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    from vllm_overlay.simulate.plan import base_files, overlay_files

    start = time.monotonic()
    base, base_where = base_files()
    overlay, overlay_where = overlay_files(base)
    print(f"hook cost: base {base_where}; overlay {overlay_where}")
    print(
        f"layouts {args.layouts}; lengths {args.lengths}; hits {args.hits} %; "
        f"{args.repeats} repeats x {args.rounds} rounds"
    )
    root = Path(tempfile.mkdtemp(prefix="vllm-overlay-hooks-"))
    variants: dict[str, dict[str, str]] = {"base": base, "overlay": overlay}
    lines: dict[str, list[Line]] = {v: [] for v in variants}
    try:
        for r in range(args.rounds):
            for v in list(variants)[:: 1 if r % 2 == 0 else -1]:
                print(f"round {r + 1}/{args.rounds}: {v}")
                lines[v] += _run_variant(v, variants[v], args, root / str(r))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = {v: pooled(vlines) for v, vlines in lines.items()}
    text, ratios = table(lines)
    print(
        "growth b/o: log-log slope of the median against the blocks a request "
        "holds, base/overlay (1.00 = linear)"
    )
    print(text)
    print()
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios if r > 0) / len(ratios))
        print(
            f"hook cost: {len(ratios)} medians; overlay/base geometric mean "
            f"x{geo:.2f}, worst x{max(ratios):.2f}; "
            f"{time.monotonic() - start:.0f} s"
        )
    else:
        took = time.monotonic() - start
        print(f"hook cost: no medians (every layout refused); {took:.0f} s")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
