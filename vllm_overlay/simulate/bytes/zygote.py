"""One variant's process: import vLLM once, then fork every configuration's
ranks from here.

Run as ``python -m vllm_overlay.simulate.bytes.zygote`` by ``run.py`` with
the ``mori`` stand-in first on ``PYTHONPATH``. Redirects the moriio package
to the variant's directory, imports what the ranks use (so a forked rank
starts in well under a second), then runs its plan one configuration at a
time (``--plan -``: as the sweep hands them over on stdin). Writes one
``Progress`` / ``ConfigReport`` per line to stdout after ``MARK``.

It ends with its parent (``lifetime.py``): on SIGTERM (sent by the kernel when
the parent ends, or by the parent) or SIGINT it kills its ranks, removes
their /dev/shm files and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from types import FrameType

import msgspec

from vllm_overlay import cpuplatform
from vllm_overlay.simulate.bytes import driver
from vllm_overlay.simulate.bytes.driver import (
    Config,
    reap_ranks,
    retire_idle,
    run_config,
)
from vllm_overlay.simulate.bytes.geometry import Geometry
from vllm_overlay.simulate.bytes.lifetime import (
    STOP_SIGNALS,
    die_with_parent_from_env,
)
from vllm_overlay.simulate.bytes.report import (
    MARK,
    ConfigItem,
    ConfigReport,
    config_name,
)
from vllm_overlay.simulate.bytes.shm import remove_shm
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.simulate.legs import LegOptions, build_leg
from vllm_overlay.simulate.lines import Progress, count_case
from vllm_overlay.simulate.plan import parse_hits, parse_lengths
from vllm_overlay.simulate.procs import Emitter, load_variant, variant_parser

emit = Emitter(MARK)


def check_standin() -> None:
    import mori.io

    if not getattr(mori.io, "STANDIN", False):
        raise SystemExit(
            f"{mori.io.__file__}: not the loopback stand-in; the byte-level "
            "simulator moves bytes over loopback only"
        )


def warm_imports() -> None:
    """Import in the zygote what every rank imports, before any fork."""
    import torch  # noqa: F401
    import vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector  # noqa: F401
    import vllm.distributed.parallel_state  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401
    import vllm.v1.executor  # noqa: F401
    import vllm.v1.worker.worker_base  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1 import (  # noqa: F401
        ssm_conv_transfer_utils,
    )
    from vllm.model_executor.layers.mamba import mamba_utils  # noqa: F401
    from vllm.v1.attention import selector  # noqa: F401

    # The worker resolves its attention backend by name, which imports the
    # platform's backend module on first use: seconds per forked rank.
    with contextlib.suppress(ImportError):
        import vllm.v1.attention.backends.cpu_attn  # noqa: F401
    # What a rank imports on first use otherwise (tenths of a second each,
    # in every one of a sweep's thousand ranks): numpy.ma through the
    # distributed setup, the executor module, the CPU communicator, and the
    # MLA layouts' backend and model config.
    import numpy.ctypeslib  # noqa: F401
    import numpy.ma  # noqa: F401
    import vllm.distributed.device_communicators.cpu_communicator  # noqa: F401
    import vllm.v1.executor.multiproc_executor  # noqa: F401

    with contextlib.suppress(ImportError):
        import vllm.v1.attention.backends.mla.cpu_mla  # noqa: F401
    with contextlib.suppress(ImportError):
        import transformers.models.deepseek_v3.configuration_deepseek_v3  # noqa: F401
    # A TP group's message-queue broadcaster registers its shared memory
    # with multiprocessing's resource tracker, a Python process started on
    # first use: started here, every rank shares this one.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    # Planner and config code import more on first use.
    build_leg(
        expand(["llama"])[0],
        "kv_producer",
        1,
        256,
        LegOptions(extra_config={"proxy_ip": ""}, with_scheduler=False),
    )


def run_item(
    variant: str,
    item: ConfigItem,
    lengths: list[int],
    hits: list[float],
) -> ConfigReport:
    config = Config(
        item.layout, item.mode, item.p_tp, item.d_tp, item.kv_layout, item.fault
    )
    if item.lengths is not None:
        lengths = parse_lengths(item.lengths)
    if item.hits is not None:
        hits = parse_hits(item.hits)
    cases = item.cases(lengths, hits)
    total = len(cases)
    report = ConfigReport(variant=variant, item=item, planned=total)
    start = time.monotonic()

    def progress(done: int) -> None:
        if done % 10 == 0:
            emit(Progress(variant, config_name(item), done, total))

    run = run_config(config, cases, Geometry(kv_heads=item.kv_heads), progress)
    report.refused = run.refused
    report.refused_at_start = run.refused_at_start
    for case in run.cases:
        report.escape_cases += case.escaped
        if count_case(report, case.error):
            continue
        if case.fault is not None:
            outcomes = report.fault_outcomes
            outcomes[case.fault] = outcomes.get(case.fault, 0) + 1
            report.fault_fired += case.fault_fired
            report.held_cases += bool(case.held_blocks)
            if case.leaks:
                report.leak_cases += 1
                if len(report.leak_notes) < 4:
                    report.leak_notes.append(f"n={case.n}: {', '.join(case.leaks)}")
            if case.fault == "hung" and len(report.wrong_notes) < 4:
                report.wrong_notes.append(f"n={case.n}: the faulted request hung")
            report.fallback_cases += case.fallback
            if case.fault == "wrong" and not case.wrong:
                report.wrong_notes += [f"n={case.n}: {note}" for note in case.notes]
                del report.wrong_notes[4:]
        elif case.fallback:
            # Recomputed: judged for stray bytes only, its moves not counted.
            report.fallback_cases += 1
            if not case.wrong:
                continue
        if case.fault is not None or not case.fallback:
            report.moved_bytes += case.moved_bytes
            report.min_bytes += case.min_bytes
        if case.wrong:
            report.wrong_cases += 1
            report.stray_cases += bool(case.stray_bytes)
            key = f"{case.hit_fraction * 100:g}"
            report.wrong_lengths.setdefault(key, []).append(case.n)
            for note in case.notes:
                if len(report.wrong_notes) < 4:
                    report.wrong_notes.append(f"n={case.n} hit {key} %: {note}")
    report.seconds = time.monotonic() - start
    return report


_ITEM = msgspec.json.Decoder(ConfigItem)


def plan_of(plan: str) -> Iterator[ConfigItem]:
    """The items of ``--plan``: a JSON list, or ``-``: one JSON item per
    line of stdin, each read when the previous one is done (the sweep hands
    out its configurations as zygotes finish theirs), until stdin closes."""
    if plan != "-":
        yield from msgspec.json.decode(plan, type=list[ConfigItem])
        return
    for line in sys.stdin:
        if line.strip():
            yield _ITEM.decode(line)


def _stop(signum: int, frame: FrameType | None) -> None:
    """Kill the ranks, remove their files, exit 128 + ``signum``."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    driver.kill_ranks()
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    die_with_parent_from_env(signal.SIGTERM)
    for s in STOP_SIGNALS:
        signal.signal(s, _stop)
    ap = variant_parser()
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--hits", required=True)
    ap.add_argument("--ports", default=None, metavar="LO-HI")
    ap.add_argument("--write-wait", type=float, default=None, metavar="SECONDS")
    args = ap.parse_args(argv)

    cpuplatform.use_in_this_process()
    # MoRIIO's KDA transfer needs the dim-first conv state layout.
    os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    check_standin()
    # Its pair's builds: a mixed pair's ranks each pick their leg's.
    load_variant(args)
    warm_imports()
    if args.ports:
        lo, _, hi = args.ports.partition("-")
        driver.PORT_RANGE = (int(lo), int(hi))
    if args.write_wait is not None:
        driver.WRITE_WAIT = args.write_wait
    lengths, hits = parse_lengths(args.lengths), parse_hits(args.hits)
    write_wait = driver.WRITE_WAIT
    for item in plan_of(args.plan):
        driver.WRITE_WAIT = write_wait if item.write_wait is None else item.write_wait
        emit(run_item(args.variant, item, lengths, hits))
    retire_idle()
    reap_ranks(wait=True)
    remove_shm(os.getpid())
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
