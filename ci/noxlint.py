"""`nox -s lint` on the overlaid vLLM files: ruff and mypy with vLLM's
settings, inside the pinned wheel's vLLM.

The files are the series' (`Series.touched_paths`, from `vllm-overlay
series check --json`), materialized from the pinned wheel. The noxfile
imports this module; nothing in the package does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import nox

from ci.noxenv import (
    CACHE,
    LINT_REQUIREMENTS,
    NO_DEPS,
    PIN,
    REQUIREMENTS,
    ROOT,
    TORCH,
    compile_cpu_env,
    cpu_python,
    lint_tools,
    pinned,
    pinned_wheel,
)
from vllm_overlay.mypybase import (
    base_key,
    errors_of_ours,
    parse_errors,
    settings_sha256,
)
from vllm_overlay.text import count


def series_check(session: nox.Session) -> list[str]:
    """`vllm-overlay series check` in the lint session's environment (nox's
    own has no msgspec); the vLLM files the series changes, as the series
    model lists them (`Series.touched_paths`)."""
    out = session.run("vllm-overlay", "series", "check", "--json", silent=True)
    text = str(out)  # nox merges stderr in: the object starts a line
    result = json.loads(
        text[text.index("{") if text.startswith("{") else text.index("\n{") :]
    )
    patches = count(len(result["patches"]), "patch", "patches")
    session.log(f"series check: ok, {patches}, series {result['series_id']}")
    return list(result["files"])


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
    python = str(cpu_python(session, compiled=False))
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
    # One mypy worker per core: the same errors, and a cold run (vLLM, torch,
    # transformers, ... read through follow_imports) no longer holds one core
    # while the other idles.
    args += ["--num-workers", str(os.cpu_count() or 1)]

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


@contextmanager
def beside(session: nox.Session, *cmd: str) -> Iterator[None]:
    """``cmd`` (a tool of the session's environment, run in the checkout)
    runs while the block does: mypy on this package shares the cores with
    the CPU environment's build and the checks of the overlaid files. Its
    output is printed whole after the block; its failure fails the session.
    A block that fails stops it."""
    name = " ".join(cmd)
    session.log(f"{name}: beside what follows, its output after it")
    proc = subprocess.Popen(
        [str(Path(session.bin) / cmd[0]), *cmd[1:]], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    out, _ = proc.communicate()
    session.log(f"{name}: exit status {proc.returncode}")
    sys.stdout.write(out)
    sys.stdout.flush()
    if proc.returncode:
        session.error(f"{name} failed (exit status {proc.returncode})")


@contextmanager
def in_thread(
    session: nox.Session, name: str, work: Callable[[], object]
) -> Iterator[None]:
    """``work`` (in the session, in a thread) while the block runs; the block
    waits for it at its end; its failure fails the session."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001  (raised in the session's thread)
            failed.append(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if failed:
        raise failed[0]


def cpu_env_beside(session: nox.Session) -> AbstractContextManager[None]:
    """The CPU environment's files installed (or found current) while the
    block runs: its installs, mostly waiting on the disk, share the cores
    with the lint tools' install and the checks that do not need the
    environment."""
    return in_thread(session, "cpu-env", lambda: cpu_python(session, compiled=False))


def lint_impl(session: nox.Session) -> None:
    # The wheel first: the environment's build installs it, materialize reads
    # it. pip downloads it from nox's own environment (uv's has no pip).
    wheel = pinned_wheel(session)
    with cpu_env_beside(session):
        lint_tools(session)
        with beside(session, "mypy"):
            touched, out = lint_rest(session, wheel)
    # mypy reads sources only: the environment's bytecode compiles beside it
    # (mypy's workers leave a core idle much of the time).
    with in_thread(session, "bytecode", lambda: compile_cpu_env(session)):
        if touched:
            mypy_overlaid(session, wheel, out, touched)
    session.log(f"lint: ok ({count(len(touched), 'overlaid vLLM file')} checked)")


def lint_rest(session: nox.Session, wheel: Path) -> tuple[list[str], Path]:
    """Everything of `lint` but the type checks; the overlaid files and the
    tree they are materialized in."""
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    touched = series_check(session)
    out = CACHE / "overlaid"
    shutil.rmtree(out, ignore_errors=True)
    session.run("vllm-overlay", "materialize", "--wheel", str(wheel), "--out", str(out))
    config = ("--config", str(ROOT / "ci" / "ruff-vllm.toml"))
    if touched:
        files = [str(out / path) for path in touched]
        session.run("ruff", "check", *config, *files)
        session.run("ruff", "format", "--check", *config, *files)
    containerfiles = [
        ROOT / "docker" / "Dockerfile",
        ROOT / "docker" / "standin" / "Containerfile",
        ROOT / "tests" / "image" / "fixtures" / "Containerfile.tiny",
    ]
    session.run("hadolint", *(str(f) for f in containerfiles))
    return touched, out
