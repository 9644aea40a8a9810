"""What an image with the overlay must hold, checked from inside it.

`vllm-overlay image verify` runs in the image's own Python: the Dockerfile's
last RUN step runs it (the build fails unless every check passes), and the
build driver runs it again in a container of the committed image. Each check
reads the installed packages themselves, never a record of the build:

- ``overlay``: every pinned MoRIIO file of this Python's vLLM is overlaid by
  the checkout's series (`status --require overlaid`);
- ``vllm-version``: ``vllm.__version__`` and the installed distribution are
  the pin's version;
- ``connector-import``: the overlaid ``moriio_connector`` module imports,
  from that vLLM, and defines the connector class;
- ``banner-plugin``: vLLM's own general-plugin loader finds our entry point
  and it logs the series line;
- ``vllm-router``: the pinned router is installed, its command on PATH,
  and every package it requires is installed (the Dockerfile installs it
  --no-deps: they are vLLM's own);
- with ``--rdma`` (what the build driver runs in the new image, the
  stand-in base aside): ``mori`` imports, ``ibverbs-provider`` (a
  libibverbs driver entry with its provider library), ``toy-proxy`` (vLLM's
  MoRIIO toy proxy starts and listens), see rdma.py.

With ``--series none`` (the A/B base image, `image build --series none`)
the ``base`` check replaces ``overlay``: every pinned MoRIIO file is the
pin's base file, untouched; the banner plugin must then log the base line.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Literal

import msgspec

from vllm_overlay.image.checks import Check, last_line
from vllm_overlay.image.rdma import TOY_PROXY, rdma_checks
from vllm_overlay.series.patch_series import Series
from vllm_overlay.series.pin import Pin
from vllm_overlay.tree.banner import installed_version, overlay_line
from vllm_overlay.tree.status import tree_status
from vllm_overlay.tree.target import detect_target, installed_vllm

REQUIREMENTS = "docker/requirements-image.txt"
BANNER_ENTRY_POINT = "vllm_overlay.tree.banner:log_overlay"
PLUGIN_GROUP = "vllm.general_plugins"
CONNECTOR_CLASS = "MoRIIOConnector"
# What the image carries: the series applied, or none (the A/B base).
SeriesMode = Literal["apply", "none"]
SERIES_MODES: tuple[SeriesMode, ...] = ("apply", "none")


class Verification(msgspec.Struct):
    python: str
    vllm_dir: str
    series_id: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)


def router_pin(repo: Path) -> str:
    """The vllm-router version docker/requirements-image.txt pins."""
    text = (repo / REQUIREMENTS).read_text()
    m = re.search(r"^vllm-router==([^\s\\;]+)", text, re.MULTILINE)
    if m is None:
        raise ValueError(f"{REQUIREMENTS} pins no vllm-router==VERSION")
    return m.group(1)


def check_overlay(vllm_dir: Path, pin: Pin, series: Series) -> Check:
    report, _ = tree_status(detect_target(vllm_dir), pin, series)
    if report.state != "overlaid":
        odd = [f"{f.path.rsplit('/', 1)[-1]}: {f.state}" for f in report.files]
        return Check("overlay", False, f"status {report.state} ({'; '.join(odd)})")
    if report.manifest_series_id != series.series_id:
        return Check(
            "overlay",
            False,
            f"files overlaid, but the manifest records series "
            f"{report.manifest_series_id or '(none)'}",
        )
    return Check(
        "overlay",
        True,
        f"series {series.series_id} overlaid on {len(report.files)} pinned files",
    )


def check_base(vllm_dir: Path, pin: Pin, series: Series) -> Check:
    """Every pinned MoRIIO file is the pin's base file (no series applied)."""
    report, _ = tree_status(detect_target(vllm_dir), pin, series)
    if report.state != "base":
        odd = [f"{f.path.rsplit('/', 1)[-1]}: {f.state}" for f in report.files]
        return Check("base", False, f"status {report.state} ({'; '.join(odd)})")
    return Check(
        "base", True, f"no series: {len(report.files)} pinned files are the base's"
    )


def same_release(found: str, pinned: str) -> bool:
    """``found`` is the pinned release, or that release with a local build
    label (`0.33.0+rocm721`: PEP 440's local segment names a build variant,
    as device builds of vLLM may)."""
    return found.partition("+")[0] == pinned


def check_version(pin: Pin) -> Check:
    try:
        dist = importlib.metadata.version("vllm")
        vllm = importlib.import_module("vllm")
    except Exception as e:  # noqa: BLE001 - any import failure is the verdict
        return Check("vllm-version", False, f"import vllm failed: {last_line(e)}")
    found = getattr(vllm, "__version__", "(no __version__)")
    if not (
        same_release(found, pin.vllm.version) and same_release(dist, pin.vllm.version)
    ):
        return Check(
            "vllm-version",
            False,
            f"vllm.__version__ {found}, distribution {dist}; the pin is "
            f"{pin.vllm.version}",
        )
    return Check("vllm-version", True, f"vllm {found} (the pin's)")


def check_connector(vllm_dir: Path, pin: Pin) -> Check:
    name = pin.module.replace("/", ".") + ".moriio_connector"
    try:
        module = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        return Check("connector-import", False, f"import {name}: {last_line(e)}")
    where = Path(module.__file__ or "").resolve()
    if not where.is_relative_to(vllm_dir.resolve()):
        return Check("connector-import", False, f"{name} imported from {where}")
    if not hasattr(module, CONNECTOR_CLASS):
        return Check("connector-import", False, f"{name} has no {CONNECTOR_CLASS}")
    return Check("connector-import", True, f"{CONNECTOR_CLASS} from {where}")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def check_banner(vllm_dir: Path, series: Series, mode: SeriesMode = "apply") -> Check:
    eps = [
        ep
        for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)
        if ep.value == BANNER_ENTRY_POINT
    ]
    if not eps:
        return Check(
            "banner-plugin",
            False,
            f"no vllm.general_plugins entry {BANNER_ENTRY_POINT}",
        )
    logger = logging.getLogger("vllm.moriio_overlay")
    capture, level = _Capture(), logger.level
    logger.addHandler(capture)
    logger.setLevel(logging.DEBUG)  # whatever vLLM's logging config says
    try:
        # What load_general_plugins() runs, without its once-per-process guard.
        plugins = importlib.import_module("vllm.plugins")
        loaded = plugins.load_plugins_by_group(PLUGIN_GROUP)
        if eps[0].name not in loaded:
            return Check(
                "banner-plugin",
                False,
                f"vLLM's loader skips {eps[0].name} (VLLM_PLUGINS?)",
            )
        loaded[eps[0].name]()
    except Exception as e:  # noqa: BLE001
        return Check("banner-plugin", False, f"vLLM's plugin loader: {last_line(e)}")
    finally:
        logger.removeHandler(capture)
        logger.setLevel(level)
    _, expected = overlay_line(vllm_dir, installed_version())
    if expected not in capture.lines:
        said = capture.lines[-1] if capture.lines else "nothing"
        return Check("banner-plugin", False, f"the plugin logged {said!r}")
    wanted = f"series {series.series_id} " if mode == "apply" else "(base)"
    if wanted not in expected:
        return Check("banner-plugin", False, expected)
    return Check("banner-plugin", True, f"{eps[0].name} logs: {expected}")


def missing_requirements(dist: str) -> list[str]:
    """The packages ``dist`` requires (no extras) that are not installed."""
    missing = []
    for req in importlib.metadata.requires(dist) or []:
        name_part, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", name_part)
        if m is None:
            continue
        try:
            importlib.metadata.version(m.group(1))
        except importlib.metadata.PackageNotFoundError:
            missing.append(m.group(1))
    return missing


def check_router(version: str) -> Check:
    try:
        found = importlib.metadata.version("vllm-router")
    except importlib.metadata.PackageNotFoundError:
        return Check("vllm-router", False, "vllm-router is not installed")
    missing = missing_requirements("vllm-router")
    if missing:
        return Check(
            "vllm-router",
            False,
            f"vllm-router {found} requires {', '.join(missing)}, not installed",
        )
    # Where this interpreter's installs put commands, then PATH.
    scripts = sysconfig.get_path("scripts")
    search = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"
    command = shutil.which("vllm-router", path=search)
    if found != version or command is None:
        return Check(
            "vllm-router",
            False,
            f"vllm-router {found} (pinned {version}), command {command or 'missing'}",
        )
    return Check("vllm-router", True, f"vllm-router {found} at {command}")


def verify_install(
    repo: Path,
    pin: Pin,
    series: Series,
    vllm_dir: Path | None = None,
    mode: SeriesMode = "apply",
    rdma: bool = False,
    toy_proxy: str = TOY_PROXY,
) -> Verification:
    """Every check, in order; a failed check does not stop the others.
    ``rdma``: also MoRI, a libibverbs provider and the toy proxy (rdma.py)."""
    vllm_dir = vllm_dir or installed_vllm()
    files = (check_overlay if mode == "apply" else check_base)(vllm_dir, pin, series)
    checks = [
        files,
        check_version(pin),
        check_connector(vllm_dir, pin),
        check_banner(vllm_dir, series, mode),
        check_router(router_pin(repo)),
        *(rdma_checks(toy_proxy) if rdma else []),
    ]
    python = f"{sys.executable} {sys.version.split()[0]}"
    series_id = series.series_id if mode == "apply" else "none"
    return Verification(python, str(vllm_dir), series_id, checks)


def format_verification(v: Verification) -> str:
    width = max(len(c.name) for c in v.checks)
    lines = [f"python: {v.python}", f"vllm: {v.vllm_dir}"]
    for c in v.checks:
        lines.append(f"  {'ok ' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}")
    passed = sum(c.ok for c in v.checks)
    verdict = "ok" if v.ok else "FAILED"
    lines.append(f"verify: {verdict}, {passed}/{len(v.checks)} checks passed")
    return "\n".join(lines)
