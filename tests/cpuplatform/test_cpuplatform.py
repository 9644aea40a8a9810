"""The test-only CPU platform: off unless VLLM_OVERLAY_CPU_PLATFORM=1, vLLM's
CpuPlatform otherwise, with the Triton requirement of vLLM 0.34.0 lifted so
the simulator's legs (MoRIIO READ, speculative configs, the KV cache planner,
a real scheduler) build on a CPU without Triton."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from typing import Any

import pytest
from packaging.version import Version

from ci import cpuenv
from tests.repo import REPO
from vllm_overlay import cpuplatform

GROUP = "vllm.platform_plugins"
ENTRY = "vllm_overlay.cpuplatform:platform_plugin"
# A plain layout, an EAGLE3 one and an MTP one: what the simulator builds.
LAYOUTS = ["llama", "gpt-oss-eagle3", "deepseek-v3-mtp"]
VLLM = Version(importlib.metadata.version("vllm"))


def test_the_plugin_is_off_without_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In the ROCm image (and anywhere the variable is not "1") vLLM picks
    its platform as if this package were not installed."""
    monkeypatch.delenv(cpuplatform.ENV, raising=False)
    assert cpuplatform.platform_plugin() is None
    for value in ("", "0", "true", "yes"):
        monkeypatch.setenv(cpuplatform.ENV, value)
        assert cpuplatform.platform_plugin() is None, value


def test_the_plugin_names_the_platform_with_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(cpuplatform.ENV, "1")
    assert cpuplatform.platform_plugin() == cpuplatform.PLATFORM
    assert cpuplatform.enabled({cpuplatform.ENV: "1"})
    assert not cpuplatform.enabled({})


def test_the_plugin_is_registered_where_vllm_looks() -> None:
    """pyproject.toml declares it, and the installed metadata vLLM reads
    holds it and loads the function."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"][GROUP]
    assert list(declared.values()) == [ENTRY]
    installed = [
        ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.value == ENTRY
    ]
    assert installed, "the editable install predates the entry point: run via nox"
    assert installed[0].load() is cpuplatform.platform_plugin


def test_importing_the_plugin_imports_no_vllm() -> None:
    """vLLM imports the plugin module while it resolves its platform, in
    every process: the module must not import vLLM itself."""
    code = (
        "import sys, vllm_overlay.cpuplatform; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('vllm', 'torch')))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_the_class_path_is_a_subclass_of_vllms_cpu_platform() -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cls = resolve_obj_by_qualname(cpuplatform.PLATFORM)
    assert issubclass(cls, CpuPlatform) and cls is not CpuPlatform
    assert cls.device_type == "cpu"
    assert cls.uses_standalone_cpu_model_runner() is False


class _Stop(Exception):
    pass


def test_vllms_config_check_runs_with_triton_available_and_restores_it() -> None:
    """The parent's check reads HAS_TRITON as True while it runs (its
    refusal on x86 without Triton does not fire) and the module attribute
    is restored afterwards, also when the check raises."""
    import vllm.triton_utils

    from vllm_overlay.cpuplatform.platform import OverlayCpuPlatform

    seen: list[bool] = []

    class Config:
        @property
        def model_config(self) -> Any:
            seen.append(vllm.triton_utils.HAS_TRITON)
            raise _Stop

    before = vllm.triton_utils.HAS_TRITON
    with pytest.raises(_Stop):
        OverlayCpuPlatform.check_and_update_config(Config())
    assert seen == [True]
    assert vllm.triton_utils.HAS_TRITON is before


def _probe(env: dict[str, str], layouts: list[str]) -> dict[str, Any]:
    """tests/cpuplatform/cpuplatform_probe.py in a fresh process (vLLM picks its
    platform once per process)."""
    full = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    full.pop(cpuplatform.ENV, None)
    full.pop("VLLM_TARGET_DEVICE", None)
    full.update(env)
    run = subprocess.run(
        [sys.executable, "-m", "tests.cpuplatform.cpuplatform_probe", *layouts],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=full,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


# vLLM asks the platform plugins only when VLLM_TARGET_DEVICE is not "cpu";
# "cuda" is its default (the environment's .pth leaves it unset anyway when
# the plugin is on).
ON = {cpuplatform.ENV: "1", "VLLM_TARGET_DEVICE": "cuda"}


def test_vllm_picks_it_and_the_simulators_legs_schedule_on_it() -> None:
    """With the variable, vLLM resolves the overlay's platform through the
    entry point, and each leg (MoRIIO READ; EAGLE3 and MTP configs; the
    planner) builds a real scheduler that schedules a 64-token prompt."""
    result = _probe(ON, LAYOUTS)
    assert result.pop("platform") == cpuplatform.PLATFORM
    specs = {"llama": None, "gpt-oss-eagle3": "eagle3", "deepseek-v3-mtp": "mtp"}
    assert result == {
        name: {"connector": "MoRIIOConnector", "speculative": spec, "scheduled": 64}
        for name, spec in specs.items()
    }


@pytest.mark.skipif(Version("0.34.0") > VLLM, reason="vLLM 0.34.0 and later")
def test_vllms_own_cpu_platform_refuses_without_triton() -> None:
    """Why the platform exists: on vLLM's CpuPlatform the same leg does not
    build on an x86 CPU without Triton, also with the plugin asked for
    while VLLM_TARGET_DEVICE=cpu (vLLM then asks no plugin).

    Without the variable vLLM picks the same CpuPlatform, whose refusal is
    the one the leg below meets; that probe builds no leg (seconds of CPU).
    In the CPU environment its .pth sets the variable in every child anyway
    (``test_the_device_pth_turns_the_platform_on_unless_told_otherwise``)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the Triton requirement is x86's")
    cpu = "vllm.platforms.cpu.CpuPlatform"
    assert _probe({"VLLM_TARGET_DEVICE": "cpu"}, []) == {"platform": cpu}
    result = _probe({**ON, "VLLM_TARGET_DEVICE": "cpu"}, ["llama"])
    assert result["platform"] == cpu
    assert "requires Triton" in result["llama"]["error"]


def test_the_device_pth_turns_the_platform_on_unless_told_otherwise() -> None:
    """The CPU environment's .pth turns the overlay's platform on unless the
    switch is set, and never sets VLLM_TARGET_DEVICE (vLLM would then skip
    the plugin)."""

    def target(env: dict[str, str]) -> str:
        show = (
            "print(os.environ.get('VLLM_TARGET_DEVICE', '-'), "
            f"os.environ.get('{cpuplatform.ENV}', '-'))"
        )
        code = f"{cpuenv.DEVICE_PTH_TEXT.strip()}; {show}"
        base = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
        base.pop(cpuplatform.ENV, None)
        run = subprocess.run(
            [sys.executable, "-S", "-c", code],
            capture_output=True,
            text=True,
            env={**base, **env},
        )
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert target({}) == "- 1"
    assert target({cpuplatform.ENV: "0"}) == "- 0"
    assert target({"VLLM_TARGET_DEVICE": "cuda"}) == "cuda 1"
    assert target({cpuplatform.ENV: "1"}) == "- 1"


def test_cpu_environ_turns_the_platform_on_and_drops_a_cpu_target() -> None:
    env = cpuplatform.cpu_environ({"VLLM_TARGET_DEVICE": "cpu", "A": "b"})
    assert env == {"A": "b", cpuplatform.ENV: "1"}
    kept = cpuplatform.cpu_environ({"VLLM_TARGET_DEVICE": "cuda"})
    assert kept == {"VLLM_TARGET_DEVICE": "cuda", cpuplatform.ENV: "1"}


@pytest.mark.parametrize(
    "probe", ["_is_amx_tile_supported", "_is_avx512_bf16_supported"]
)
def test_vllms_config_check_reads_the_cpu_features_and_restores_them(
    monkeypatch: pytest.MonkeyPatch, probe: str
) -> None:
    """On a CPU without the feature the parent's check still reads it as
    present, and the probe is the machine's again afterwards, also when
    the check raises."""
    import torch

    from vllm_overlay.cpuplatform.platform import OverlayCpuPlatform

    monkeypatch.setattr(torch.cpu, probe, lambda: False)
    machine = getattr(torch.cpu, probe)
    seen: list[bool] = []

    class Config:
        @property
        def model_config(self) -> Any:
            seen.append(getattr(torch.cpu, probe)())
            raise _Stop

    with pytest.raises(_Stop):
        OverlayCpuPlatform.check_and_update_config(Config())
    assert seen == [True]
    assert getattr(torch.cpu, probe) is machine


def test_an_mla_config_keeps_prefix_caching_on_a_cpu_without_amx(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """vLLM's CPU check turns prefix caching and chunked prefill off for
    an MLA model, and forces its block size to 16, where its AMX kernels
    are missing; the configs the tests build keep what was asked, whatever
    CPU runs them."""
    import torch

    from tests.patches.builders import (
        TINY_DEEPSEEK_MTP_CONFIG,
        make_vllm_config,
        moriio_kv_transfer_config,
        write_model_dir,
    )

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    model_dir = write_model_dir(tmp_path, TINY_DEEPSEEK_MTP_CONFIG)
    config = make_vllm_config(
        model_dir, moriio_kv_transfer_config("kv_consumer"), block_size=64
    )
    assert config.model_config.use_mla
    assert config.cache_config.enable_prefix_caching
    assert config.scheduler_config.enable_chunked_prefill
    assert config.cache_config.block_size == 64


def test_a_config_built_here_leaves_the_environment_of_later_children(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """vLLM's check sets its executor workers' variables (LD_PRELOAD of its
    tcmalloc and torch's libgomp, thread counts); none runs here, so the
    process environment is as it was, but for the Mamba conv state layout
    vLLM reads later in this process."""
    from tests.patches.builders import (
        TINY_DEEPSEEK_MTP_CONFIG,
        make_vllm_config,
        moriio_kv_transfer_config,
        write_model_dir,
    )

    for name in (
        "LOCAL_WORLD_SIZE",
        "NUMEXPR_MAX_THREADS",
        "VLLM_SSM_CONV_STATE_LAYOUT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    before = dict(os.environ)
    model_dir = write_model_dir(tmp_path, TINY_DEEPSEEK_MTP_CONFIG)
    make_vllm_config(model_dir, moriio_kv_transfer_config("kv_consumer"))
    after = dict(os.environ)
    assert after.pop("VLLM_SSM_CONV_STATE_LAYOUT") == "SD"
    assert after == before
