"""A test-only CPU platform for vLLM, off unless ``VLLM_OVERLAY_CPU_PLATFORM=1``.

vLLM 0.34.0's ``CpuPlatform`` refuses every ``VllmConfig`` on an x86 CPU
without a Triton CPU backend ("vLLM on x86 CPUs requires Triton
(triton-cpu)"; 0.33.0 only warned), and no PyPI Triton has one. The
scheduler, the KV cache planner and the MoRIIO connector's scheduler and
worker code never run a Triton kernel, so the tests and the simulator run
them on ``OverlayCpuPlatform`` (``platform.py``): vLLM's ``CpuPlatform``
with that one requirement lifted.

vLLM finds it through the entry point group ``vllm.platform_plugins``
(``platform_plugin`` below), and an out-of-tree platform that activates
wins over the built-in ones. Two conditions:

- ``VLLM_OVERLAY_CPU_PLATFORM=1``; otherwise ``platform_plugin`` returns
  None and vLLM picks its platform as if this package were not installed
  (the ROCm image installs it too);
- ``VLLM_TARGET_DEVICE`` is not ``cpu``: vLLM (0.33.0 and 0.34.0) takes an
  explicit CPU target as its built-in ``CpuPlatform`` without asking any
  plugin.

Standard library only: vLLM imports this module while it resolves its
platform, in every process where the package is installed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "VLLM_OVERLAY_CPU_PLATFORM"
PLATFORM = "vllm_overlay.cpuplatform.platform.OverlayCpuPlatform"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (default: this process's) asks for the platform."""
    env = os.environ if environ is None else environ
    return env.get(ENV, "") == "1"


def cpu_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) for a child that runs vLLM on
    this platform: the switch on, and an explicit ``VLLM_TARGET_DEVICE=cpu``
    (which would bypass the plugins) dropped."""
    env = dict(os.environ if environ is None else environ)
    env[ENV] = "1"
    if env.get("VLLM_TARGET_DEVICE") == "cpu":
        del env["VLLM_TARGET_DEVICE"]
    return env


def use_in_this_process() -> None:
    """Turn the platform on for this process; call before vLLM is imported."""
    os.environ[ENV] = "1"
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        del os.environ["VLLM_TARGET_DEVICE"]


def platform_plugin() -> str | None:
    """vLLM platform plugin: the platform's class path when enabled, else None."""
    return PLATFORM if enabled() else None
