"""The start-up banner: which overlay runs, read from the manifest apply wrote
and checked against the files."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest

from tests.child import run_python
from tests.image.conftest import COMMON
from vllm_overlay import cpuplatform
from vllm_overlay.e2e.checks import BANNER
from vllm_overlay.series.patch_series import load_series
from vllm_overlay.series.pin import Pin
from vllm_overlay.tree.apply import apply_series
from vllm_overlay.tree.banner import installed_version, overlay_line
from vllm_overlay.tree.moriio_mode import mode_line
from vllm_overlay.tree.target import detect_target, installed_vllm


def test_overlaid_tree_names_its_series(
    site: Path, one_patch_repo: Path, pin: Pin
) -> None:
    series = load_series(one_patch_repo)
    apply_series(detect_target(site / "vllm"), pin, series)
    level, text = overlay_line(site / "vllm", "0.33.0")
    assert level == logging.INFO
    assert text == (
        f"vllm-moriio-overlay: series {series.series_id} (0001-image-test) "
        "on vLLM 0.33.0"
    )
    m = BANNER.search(text)
    assert m is not None and m.group(1) == series.series_id


def test_base_tree_says_so(site: Path) -> None:
    level, text = overlay_line(site / "vllm", "0.33.0")
    assert level == logging.INFO
    assert "no overlay manifest" in text and "base" in text
    assert BANNER.search(text) is None


def test_files_changed_after_apply_are_unknown(
    site: Path, one_patch_repo: Path, pin: Pin
) -> None:
    apply_series(detect_target(site / "vllm"), pin, load_series(one_patch_repo))
    for rel in (COMMON,):  # the files the series touches are recorded
        f = site / rel
        original = f.read_text()
        f.write_text(original + "# edited in the image\n")
        level, text = overlay_line(site / "vllm", "0.33.0")
        assert level == logging.WARNING
        assert f"{rel} does not match the manifest" in text
        assert BANNER.search(text) is None
        f.write_text(original)
    assert overlay_line(site / "vllm", "0.33.0")[0] == logging.INFO


_LOAD_PLUGINS = (
    "from vllm.config.logging import LoggingConfig\n"
    "from vllm.logger import configure_logging\n"
    "from vllm.plugins import load_general_plugins\n"
    "configure_logging(LoggingConfig())\n"
    "load_general_plugins()\n"
)


@functools.cache
def _load_plugins_as_vllm_serves(*argv: str) -> str:
    """vLLM's own general-plugin loading, with logging configured as `vllm
    serve` does, in a process whose command line ends in ``argv``: its output
    (one process per command line: each imports vLLM)."""
    env = {**cpuplatform.cpu_environ(), "VLLM_LOGGING_LEVEL": "INFO"}
    result = run_python(_LOAD_PLUGINS, *argv, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def test_vllm_plugin_loader_logs_the_banner() -> None:
    """With logging configured as `vllm serve` does, vLLM's own general-plugin
    loading runs the entry point and the line reaches vLLM's log output
    (the process of the WRITE mode test below: the banner does not depend on
    the command line)."""
    out = _load_plugins_as_vllm_serves("--kv-transfer-config", _kv({}))
    _, expected = overlay_line(installed_vllm(), installed_version())
    assert expected in out, out[-2000:]


def _kv(extra: dict[str, object], connector: str = "MoRIIOConnector") -> str:
    return json.dumps({"kv_connector": connector, "kv_connector_extra_config": extra})


@pytest.mark.parametrize(
    ("extra", "mode"),
    [
        ({}, "MoRIIO mode WRITE (read_mode unset: vLLM's default)"),
        ({"read_mode": True}, "MoRIIO mode READ (read_mode True)"),
        ({"read_mode": "1"}, "MoRIIO mode READ (read_mode '1')"),
        ({"read_mode": False}, "MoRIIO mode WRITE (read_mode False)"),
        ({"read_mode": "yes"}, "MoRIIO mode WRITE (read_mode 'yes')"),
    ],
)
def test_mode_line_says_what_moriio_runs(extra: dict[str, object], mode: str) -> None:
    for argv in (
        ["vllm", "serve", "m", "--kv-transfer-config", _kv(extra)],
        ["vllm", "serve", "m", f"--kv-transfer-config={_kv(extra)}"],
    ):
        assert mode_line(argv, {}) == (logging.INFO, f"vllm-moriio-overlay: {mode}")


def test_mode_line_warns_of_the_ignored_environment_switch() -> None:
    argv = ["vllm", "serve", "m", "--kv-transfer-config", _kv({})]
    level, text = mode_line(argv, {"VLLM_MORIIO_CONNECTOR_READ_MODE": "1"}) or (0, "")
    assert level == logging.WARNING
    assert "MoRIIO mode WRITE" in text
    assert "VLLM_MORIIO_CONNECTOR_READ_MODE is set and ignored by vLLM" in text


def test_mode_line_only_for_moriio() -> None:
    assert mode_line(["vllm", "serve", "m"], {}) is None
    argv = ["vllm", "serve", "m", "--kv-transfer-config", _kv({}, "NixlConnector")]
    assert mode_line(argv, {}) is None
    level, text = mode_line(["--kv-transfer-config", "{oops"], {}) or (0, "")
    assert level == logging.WARNING
    assert text.startswith("vllm-moriio-overlay: cannot tell the MoRIIO mode:")


@pytest.mark.parametrize(
    ("extra", "mode"), [({}, "WRITE"), ({"read_mode": True}, "READ")]
)
def test_vllm_plugin_loader_logs_the_mode(extra: dict[str, object], mode: str) -> None:
    """Through vLLM's own plugin loading, in a process whose command line
    configures MoRIIO (as `vllm serve`'s does), the banner names the mode."""
    out = _load_plugins_as_vllm_serves("--kv-transfer-config", _kv(extra))
    assert f"vllm-moriio-overlay: MoRIIO mode {mode}" in out, out[-2000:]
