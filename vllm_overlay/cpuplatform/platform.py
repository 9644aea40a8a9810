"""``OverlayCpuPlatform``: vLLM's ``CpuPlatform`` without its Triton requirement.

Only the config check differs: vLLM's own ``check_and_update_config`` runs
whole, with ``vllm.triton_utils.HAS_TRITON`` reading True while it runs, so
its "requires Triton (triton-cpu)" refusal (0.34.0; a warning on 0.33.0)
does not fire and every other adjustment it makes is vLLM's. Configs also
build the same on every CPU architecture: the standalone no-Triton model
runner, whose refusals (speculative decoding) apply off x86, is never
chosen. No model runs on this platform.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cpu import CpuPlatform


class OverlayCpuPlatform(CpuPlatform):  # type: ignore[misc]  # vLLM: untyped here
    """vLLM's CPU platform for the scheduler, the KV cache planner and the
    connector, on a CPU without Triton (``vllm_overlay.cpuplatform``)."""

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        # Imported here: vllm.triton_utils reads vllm.platforms.current_platform,
        # which is still being resolved while this class loads.
        import vllm.triton_utils

        saved = vllm.triton_utils.HAS_TRITON
        vllm.triton_utils.HAS_TRITON = True
        try:
            super().check_and_update_config(vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = saved

    @classmethod
    def uses_standalone_cpu_model_runner(cls) -> bool:
        return False
