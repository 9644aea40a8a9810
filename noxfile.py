"""Every workflow of vllm-moriio-overlay is a nox session.

Sessions are a few lines each. The environment they run in (the CPU vLLM
environment `.nox/cpu-vllm`, the pinned wheels) is built by ci/noxenv.py,
the lint of the overlaid vLLM files is ci/noxlint.py, and the gate's run
order is `vllm-overlay gate` (vllm_overlay/gate/sequence.py).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ci import cpuenv, noxenv  # noqa: E402  (stdlib only)
from ci.noxenv import cpu_python, overlay, pinned_wheel  # noqa: E402
from ci.noxlint import lint_impl  # noqa: E402
from vllm_overlay import noxlog, noxterm  # noqa: E402  (stdlib only)
from vllm_overlay.gate import pytestargs  # noqa: E402  (the same)
from vllm_overlay.gate.phases import PHASES_FILE, timed  # noqa: E402  (the same)

noxlog.drop_uv_note(logging.getLogger("nox"))

# uv (ci/requirements-nox.txt) fills the tool environments; venv where it is missing.
nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "unit"]

ROOT, CACHE, REPORTS = noxenv.ROOT, noxenv.CACHE, noxenv.REPORTS
# This nox run: the gate's phases file holds one run's phases only.
GATE_RUN = f"{os.getpid()}@{time.time():.0f}"


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, mypy, the series check and hadolint; ruff also on the overlaid vLLM files.

    ruff on our code and, with vLLM's settings, on the overlaid vLLM files;
    the type check; the series check; hadolint on the Dockerfile.
    """
    with timed(REPORTS / PHASES_FILE, "lint", GATE_RUN):
        lint_impl(session)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on vllm_overlay (also part of `lint`)."""
    noxenv.typecheck_impl(session)


@nox.session(venv_backend="none")
def unit(session: nox.Session) -> None:
    """Every test, on CPU, against vLLM with the series applied, in shards.

    The files in shards by their recorded seconds, handed to the cores as
    they free up (as in unit-base, without its evidence); `-- tests/AREA -k
    EXPR` narrows it. A test id (`FILE::TEST`) runs in one plain pytest
    process.
    """
    python = cpu_python(session)
    overlay(session, python, "apply")
    if pytestargs.names_a_test(session.posargs):
        noxenv.suite(session, python)
        return
    paths, rest = pytestargs.split_paths(ROOT, session.posargs)
    env = noxenv.suite_env(session)
    out = REPORTS / "unit"
    shutil.rmtree(out, ignore_errors=True)
    args = ("--out", str(out), "--no-evidence", "--check", *noxenv.times_args())
    args += (f"--pytest-args={' '.join(shlex.quote(a) for a in rest)}", *paths)
    overlay(session, python, "suite", *args, env=env)


@nox.session(name="unit-base", venv_backend="none")
def unit_base(session: nox.Session) -> None:
    """The suite overlaid, what can differ on the base, each patch below its stack.

    `vllm-overlay gate` (`vllm-overlay gate --plan` prints its steps): the
    suite with the series, recording which tests read vLLM's MoRIIO package;
    those tests and a sample of the others on the pinned base; each patch's
    named tests on the stack levels in between (the per-patch revert-red
    table and its verdict); the whole export; a small byte sweep. Arguments
    after `--` go to pytest in the overlay and base runs.
    """
    python = cpu_python(session)
    env = noxenv.suite_env(session)
    posargs = " ".join(shlex.quote(a) for a in session.posargs)
    args = ("--run", GATE_RUN, f"--pytest-args={posargs}")
    overlay(session, python, "gate", *args, env=env)


@nox.session(venv_backend="none")
def dev(session: nox.Session) -> None:
    """`.venv`: the overlaid vLLM for imports, tests, status and simulate; not serving.

    `.venv` is a link to `.nox/cpu-vllm`, the environment the test sessions
    use: one build, one copy on disk.
    """
    python = cpu_python(session)
    try:
        done = cpuenv.link_dev_env(noxenv.DEV_ENV, noxenv.CPU_ENV, noxenv.CPU_ENV_STAMP)
    except FileExistsError as e:
        session.error(str(e))
    if done:
        session.log(done)
    overlay(session, python, "apply")
    overlay(session, python, "status")
    session.log(
        f"dev: activate with `source {noxenv.DEV_ENV.relative_to(ROOT)}/bin/activate`"
    )


@nox.session(venv_backend="none")
def simulate(session: nox.Session) -> None:
    """The CPU prefill/decode simulator: base vs overlay, and a verdict on the overlay.

    `nox -s simulate -- --lengths 1-4096` tries every length, most of them
    extrapolated from small cases (`-- --whole` runs each one). READ and
    WRITE, a row each (`-- --modes read` for READ alone; docs/simulate-write.md).
    Exit status 1 when the overlay moves wrong KV, crashes or runs no case in
    a layout docs/known-gaps.toml does not list. Opt-in (docs/simulate-pairs.md):
    `-- --variant mixed` (a base prefiller with an overlaid decoder and the
    reverse), `-- --faults` (each refusal path through the real scheduler).
    """
    # The JSON report: .nox-reports/simulate.json for the full run, a name of
    # its own for a run given --layouts, --lengths, ... (or --report's).
    overlay(session, cpu_python(session), "simulate", *session.posargs)


@nox.session(name="simulate-bytes", venv_backend="none")
def simulate_bytes(session: nox.Session) -> None:
    """Byte level: real MoRIIO workers move real KV cache tensors, base vs overlay.

    Both legs' real MoRIIO workers move real KV cache tensors over a loopback
    stand-in for mori, base vs overlay, every layout, mode, TP pair and KV
    cache layout; prints the table. Arguments after `--` go to
    `vllm-overlay simulate-bytes` (e.g. `-- --layouts llama --modes read`;
    opt-in `-- --variant mixed`: mixed pairs of builds, docs/simulate-pairs.md).
    """
    # The JSON report: .nox-reports/simulate-bytes.json for the full run, a name
    # of its own for a targeted run (or --report's). The run ends with nox,
    # however nox ends (simulate/bytes/lifetime.py).
    parent = {"VLLM_OVERLAY_PARENT_PID": str(os.getpid())}
    args = ("simulate-bytes", *session.posargs)
    overlay(session, cpu_python(session), *args, env=parent)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks: figures printed, never asserted.

    Every script under benchmarks/; `nox -s bench -- NAME [ARGS]` runs one,
    with its arguments.
    """
    chosen, args = noxenv.benchmarks(session)
    python = str(cpu_python(session))
    for script in chosen.values():
        session.run(python, str(script), *args, env=noxenv.TEST_ENV, external=True)
    session.log(f"bench: {len(chosen)} benchmark(s): {', '.join(chosen)}")


@nox.session(venv_backend="none")
def export(session: nox.Session) -> None:
    """Each patch as an upstream-ready mail and PR body under dist/upstream/.

    Needs the report of `nox -s unit-base` for the current series.
    """
    python = cpu_python(session)
    args = ("export", "--run-tests", *session.posargs)
    overlay(session, python, *args, env=noxenv.wheel_env(session))


@nox.session(venv_backend="none")
def rebase(session: nox.Session) -> None:
    """Move the series to another vLLM: `-- --to VERSION|WHEEL|DIR [--write]`.

    `-- --series-ref series-0.33.0 --to 0.34.0`: the series of a git ref
    (its own pinned wheel comes from the cache, fetched when missing).
    """
    wheel = pinned_wheel(session)  # also the cached wheel `--to <pinned>` finds
    from_ref = any(a.split("=", 1)[0] == "--series-ref" for a in session.posargs)
    base = () if from_ref else ("--wheel", str(wheel))
    args = ("rebase", *base, "--cache", str(CACHE / "wheels"), *session.posargs)
    overlay(session, cpu_python(session), *args)


@nox.session
def image(session: nox.Session) -> None:
    """Build the ROCm image and check it from inside.

    `nox -s image -- [--tag T] [--push] [--dry-run] [--base IMAGE]`.
    """
    noxenv.install_checkout(session)
    session.run("vllm-overlay", "image", "build", *session.posargs)


@nox.session(name="image-standin")
def image_standin(session: nox.Session) -> None:
    """A real build from a local stand-in base, checked from inside; its failure cases.

    docker/Dockerfile built for real from a local stand-in for the ROCm
    base (buildah here), checked from inside; then the build's failure cases.
    """
    session.run("sh", str(ROOT / "ci" / "install-image-tools.sh"), external=True)
    session.install(
        "-e", ".", *noxenv.pinned(noxenv.TEST_REQUIREMENTS, "pytest", "hypothesis")
    )
    wheel = pinned_wheel(session)
    reports = noxenv.standin_builds(session, wheel)
    env = {"VLLM_OVERLAY_IMAGE_BUILDS": "1", "VLLM_OVERLAY_WHEEL": str(wheel)}
    session.run(
        "python", "-m", "pytest", "-q", "tests/image/test_build_real.py", env=env
    )
    noxenv.say_standin_builds(session, reports)


# Seconds nox waits for the E2E harness to tear down after Ctrl-C.
E2E_TEARDOWN_S = 600.0


@nox.session
def e2e(session: nox.Session) -> None:
    """MoRIIO READ P/D on real nodes, N prefill x M decode, over ssh or Slurm.

    `nox -s e2e -- --config F [--launcher slurm] [--dry-run]`. A light
    environment (this package and tokenizers): the GPU nodes run vLLM in the
    image, the harness never imports it.
    """
    noxenv.install_checkout(session, "[e2e]")
    # The preflight (and every real run's first step) builds vLLM's engine
    # config on CPU: it runs in the dev environment (`nox -s dev`).
    env = {"VLLM_OVERLAY_PREFLIGHT_PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    # Ctrl-C: nox sends SIGTERM 0.3 s after SIGINT and SIGKILL 0.2 s later;
    # the harness needs that long to remove every container or cancel its
    # Slurm job, and ignores further signals while it does. A SIGTERM to
    # nox alone is passed on to the harness and handled like Ctrl-C.
    with noxterm.sigterm_forwarded():
        session.run(
            "vllm-overlay", "e2e", *session.posargs, env=env,
            interrupt_timeout=E2E_TEARDOWN_S, terminate_timeout=E2E_TEARDOWN_S,
        )  # fmt: skip
