"""`e2e --ab`: the base image and the overlay image on the same nodes, side
by side; its dry run; a whole A/B run against the fake engine, whose base
image reads wrong KV at the lengths the base's rules predict."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tests.e2e.conftest import BANNER, EXAMPLES, SERIES, loopback_config, write_config
from vllm_overlay.cli import main
from vllm_overlay.e2e.ab import AbReport, base_image
from vllm_overlay.e2e.cli import series_patches
from vllm_overlay.e2e.config import ConfigError, RunConfig, load_config
from vllm_overlay.e2e.expect import Expectations, Geometry, sweep_lengths

OVERLAY_IMAGE = "registry.example.com/overlay:v9-overlay"
BASE_IMAGE = "registry.example.com/overlay:v9-base"


def base_predicted(config: RunConfig) -> list[int]:
    geo = Geometry.of(config)
    exp = Expectations(geo, [])
    return [n for n in sweep_lengths(geo, config.checks) if exp.verdict(n).base]


def test_the_base_image_is_the_overlay_tag_with_base() -> None:
    config = load_config(EXAMPLES / "dsv4-pro-1p1d.toml")
    assert config.container.image.endswith("-overlay")
    assert base_image(config) == config.container.image.removesuffix("overlay") + (
        "base"
    )
    odd = msgspec.structs.replace(
        config,
        container=msgspec.structs.replace(config.container, image="reg/x:latest"),
    )
    with pytest.raises(ConfigError, match="--ab: no base image for reg/x:latest"):
        base_image(odd)
    named = msgspec.structs.replace(
        odd, container=msgspec.structs.replace(odd.container, base_image="reg/x:b")
    )
    assert base_image(named) == "reg/x:b"


def test_dry_run_ab_prints_both_plans_and_what_differs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = EXAMPLES / "dsv4-pro-1p1d.toml"
    config = load_config(example)
    argv = ["e2e", "--config", str(example), "--dry-run", "--ab", "--run-id", "t1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    base = base_image(config)
    over = config.container.image
    assert f"# ===== A/B, the base image: {base} =====" in lines
    assert f"# ===== A/B, the overlay image: {over} =====" in lines
    assert lines.index(f"# ===== A/B, the base image: {base} =====") < lines.index(
        f"# ===== A/B, the overlay image: {over} ====="
    )
    # Each plan starts its own image, under its own run id.
    assert "--name moriio-e2e-dsv4-pro-1p1d-t1b-prefill-0" in out
    assert "--name moriio-e2e-dsv4-pro-1p1d-t1o-prefill-0" in out
    wrong = base_predicted(config)
    assert len(wrong) == 86
    assert (
        f"- base: 86 of 128 lengths expected wrong (lookahead-shift, window-start): "
        f"{' '.join(map(str, wrong))}" in lines
    )
    assert "- overlay: 0 of 128 lengths expected wrong" in lines
    assert lines[-1] == (
        "e2e dry run dsv4-pro-1p1d --ab: 1 prefill x 1 decode, launcher ssh, 128 "
        f"sweep lengths on both images, one after the other; base {base}: 86 "
        f"expected to fail; overlay {over}: 0 expected to fail"
    )


def ab_config(tokenizer: Path) -> RunConfig:
    return loopback_config(
        tokenizer, container__image=OVERLAY_IMAGE, model__kv_bytes_per_token=1024
    )


@pytest.fixture
def overlay_banner(monkeypatch: pytest.MonkeyPatch) -> str:
    found = series_patches()
    assert found is not None
    monkeypatch.setenv("STANDIN_BANNER", BANNER.replace(SERIES, found[0]))
    monkeypatch.setenv("STANDIN_BASE_IMAGE", BASE_IMAGE)
    return found[0]


def test_an_ab_run_reports_the_base_failures_as_expected(
    fake_docker: Path, tokenizer_json: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    overlay_banner: str,
) -> None:  # fmt: skip
    config = ab_config(tokenizer_json)
    wrong = base_predicted(config)
    assert wrong
    monkeypatch.setenv("STANDIN_BASE_WRONG", ",".join(map(str, wrong)))
    path = write_config(config, tmp_path / "run.toml")
    run_dir = tmp_path / "run"
    argv = ["e2e", "--config", str(path), "--run-dir", str(run_dir), "--ab",
            "--no-preflight", "--run-id", "ab1"]  # fmt: skip
    code = main(argv)
    out = capsys.readouterr().out
    ab = msgspec.json.decode((run_dir / "ab.json").read_bytes(), type=AbReport)
    assert code == 0, out[-3000:]
    base, over = ab.sides
    assert (base.side, base.image, base.series_id) == ("base", BASE_IMAGE, "none")
    assert (over.side, over.image, over.series_id) == (
        "overlay", OVERLAY_IMAGE, overlay_banner,
    )  # fmt: skip
    assert base.wrong == wrong and base.predicted == wrong and not base.unexpected
    assert over.wrong == [] and over.error == "" and base.error == ""
    assert base.kv_bytes == base.kv_tokens * 1024 > 0
    # Both runs' own reports, each under its side.
    assert (run_dir / "base" / "report.md").read_text().startswith("# MoRIIO E2E: FAIL")
    assert (
        (run_dir / "overlay" / "report.md").read_text().startswith("# MoRIIO E2E: PASS")
    )
    md = (run_dir / "ab.md").read_text()
    assert md.startswith("# MoRIIO E2E A/B: PASS")
    assert f"| image | `{BASE_IMAGE}` | `{OVERLAY_IMAGE}` |" in md
    assert "| unexpected | none | none |" in md
    assert out.rstrip().splitlines()[-1] == (
        f"e2e A/B loop: PASS; base {len(wrong)} wrong ({len(wrong)} predicted, 0 "
        "unexpected); overlay 0 wrong (0 predicted, 0 unexpected)"
    )
    assert not list(fake_docker.glob("*.json"))  # every container removed


@pytest.mark.usefixtures("fake_docker", "overlay_banner")
def test_an_unexpected_failure_fails_the_ab_run(
    tokenizer_json: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = ab_config(tokenizer_json)
    lengths = sweep_lengths(Geometry.of(config), config.checks)
    wrong = base_predicted(config)
    extra = next(n for n in lengths if n not in wrong)
    monkeypatch.setenv("STANDIN_BASE_WRONG", ",".join(map(str, [*wrong, extra])))
    path = write_config(config, tmp_path / "run.toml")
    run_dir = tmp_path / "run"
    argv = ["e2e", "--config", str(path), "--run-dir", str(run_dir), "--ab",
            "--no-preflight"]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    ab = msgspec.json.decode((run_dir / "ab.json").read_bytes(), type=AbReport)
    assert ab.sides[0].unexpected == [extra]
    assert out.rstrip().splitlines()[-1].startswith("e2e A/B loop: FAIL; base ")


def test_a_base_that_logs_the_series_is_not_the_base(tmp_path: Path) -> None:
    from vllm_overlay.e2e.ab import side_of
    from vllm_overlay.e2e.checks import NO_SERIES, overlay_section
    from vllm_overlay.e2e.report import Report

    line = f"INFO vllm-moriio-overlay: series {SERIES} (0001-a) on vLLM 9"
    banner = overlay_section({"prefill-0": line, "decode-0": line}, NO_SERIES)
    report = Report(BASE_IMAGE, SERIES, {}, [banner])
    side = side_of("base", report, tmp_path / "report.md")
    assert not side.banner_ok and not side.ok
