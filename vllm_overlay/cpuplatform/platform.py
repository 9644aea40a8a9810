"""``OverlayCpuPlatform``: vLLM's ``CpuPlatform`` without its Triton requirement.

Only the config check differs: vLLM's own ``check_and_update_config`` runs
whole, with ``vllm.triton_utils.HAS_TRITON`` reading True while it runs, so
its "requires Triton (triton-cpu)" refusal (0.34.0; a warning on 0.33.0)
does not fire and every other adjustment it makes is vLLM's. Configs also
build the same on every CPU architecture: the standalone no-Triton model
runner, whose refusals (speculative decoding) apply off x86, is never
chosen; and while the check runs, the CPU reads as having AMX tiles and
AVX-512 BF16 (``CPU_FEATURES``), so the choices vLLM makes for its own CPU
kernels do not change the config with the machine: without AMX it turns
prefix caching and chunked prefill off for every MLA model and forces
their block size to 16, a config no GPU deployment runs. No model runs on
this platform, so no kernel of those features is ever called.

The check leaves the process environment as it found it but for
``KEPT_ENV``: vLLM's check writes the variables its CPU executor's workers
start with (``LD_PRELOAD`` of its tcmalloc and torch's libgomp, thread
counts, the multiprocessing method), and no executor runs here; left set,
they would reach every later child of the process (a test's, a simulated
rank's), which would start with vLLM's allocator preloaded or not depending
on whether some config was built before it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from vllm.platforms.cpu import CpuPlatform

# The torch.cpu probes vLLM's CPU config check reads, as a CPU that has them.
CPU_FEATURES = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
# Set by vLLM's config check and read later in this process: when vLLM
# first shapes a Mamba cache.
KEPT_ENV = frozenset({"VLLM_SSM_CONV_STATE_LAYOUT"})


@contextlib.contextmanager
def _cpu_features_present() -> Iterator[None]:
    saved = {name: getattr(torch.cpu, name) for name in CPU_FEATURES}
    try:
        for name in CPU_FEATURES:
            setattr(torch.cpu, name, lambda: True)
        yield
    finally:
        for name, probe in saved.items():
            setattr(torch.cpu, name, probe)


def _restore_environ(before: Mapping[str, str]) -> None:
    """``os.environ`` back to ``before``, but for ``KEPT_ENV``."""
    for name in set(os.environ) - set(before) - KEPT_ENV:
        del os.environ[name]
    for name, value in before.items():
        if name not in KEPT_ENV and os.environ.get(name) != value:
            os.environ[name] = value


class OverlayCpuPlatform(CpuPlatform):  # type: ignore[misc]  # vLLM: untyped here
    """vLLM's CPU platform for the scheduler, the KV cache planner and the
    connector, on a CPU without Triton (``vllm_overlay.cpuplatform``)."""

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        # Imported here: vllm.triton_utils reads vllm.platforms.current_platform,
        # which is still being resolved while this class loads.
        import vllm.triton_utils

        saved = vllm.triton_utils.HAS_TRITON
        environ = dict(os.environ)
        vllm.triton_utils.HAS_TRITON = True
        try:
            with _cpu_features_present():
                super().check_and_update_config(vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = saved
            _restore_environ(environ)

    @classmethod
    def uses_standalone_cpu_model_runner(cls) -> bool:
        return False
