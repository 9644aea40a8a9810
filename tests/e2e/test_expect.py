"""The expected failures per prompt length (expect.py) against the CPU
simulator (the real schedulers and connector), and every example's dry run
naming the lengths that fail on the base image and why (defect 1)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.e2e.conftest import ALL_EXAMPLES, EXAMPLES, REPO
from vllm_overlay.cli import main
from vllm_overlay.e2e import basestarts
from vllm_overlay.e2e.basestarts import HYBRID_PROBE, RECORDED, BaseStarts
from vllm_overlay.e2e.config import Checks, load_config
from vllm_overlay.e2e.expect import (
    HYBRID_GROUPS,
    MISSING_PAGES,
    RINGS,
    TRIM_BEFORE_CLIP,
    WINDOW_START,
    Expectations,
    Geometry,
    patch_slug,
    prefix_read,
    sweep_lengths,
)
from vllm_overlay.series.patch_series import load_series
from vllm_overlay.series.pin import PIN_FILE, load_pin
from vllm_overlay.simulate import procs
from vllm_overlay.simulate.plan import PlanItem, base_files, overlay_files
from vllm_overlay.simulate.run import _DECODER, MARK

# The example: MTP x9 on both servers, 9 lookahead slots on each leg.
DSV4 = Geometry.of(load_config(EXAMPLES / "dsv4-pro-1p1d.toml"))
# The upstream run of vLLM #62165: the 9 slots on the decode server only.
DSV4_UPSTREAM = dataclasses.replace(DSV4, prefill_lookahead=0)
GEMMA = Geometry(16, 1, 512, 16, False, 1, 0, 0, ())
SEED_001 = (251, 377, 384, 440, 447, 636, 832, 895)


def test_the_series_carries_the_patches_the_rules_name() -> None:
    slugs = {patch_slug(p.name) for p in load_series(REPO).patches}
    assert {HYBRID_GROUPS, TRIM_BEFORE_CLIP, MISSING_PAGES, WINDOW_START} <= slugs


@pytest.fixture(scope="module")
def simulated() -> dict[tuple[str, str], object]:
    """The simulator's verdicts on the base and with this checkout's series."""
    base, _ = base_files()
    over, _ = overlay_files(base)
    plan = [
        PlanItem.of("dsv4", "1-1100", "0"),
        PlanItem.of("dsv4-both/dcp1", "1-1100", "0"),
        PlanItem.of("gemma", "500-660", "0"),
        PlanItem.of("glm", "100", "0"),
    ]

    def run(variant: str, files: dict[str, str], port: int) -> list[Any]:
        # The simulator's worker, also knowing the example's dsv4 deployment.
        return procs.run_variant_process(
            variant,
            files,
            lambda moriio_dir: procs.start(
                "tests.e2e.simlayouts",
                [*procs.variant_args(moriio_dir, variant, plan), f"--port={port}"],
            ),
            MARK,
            _DECODER,
        )

    jobs = (("base", base, 46100), ("overlay", over, 46200))
    with ThreadPoolExecutor(len(jobs)) as pool:
        done = pool.map(lambda job: run(*job), jobs)
        return {(r.variant, r.layout): r for reports in done for r in reports}


@pytest.mark.parametrize(
    ("layout", "geo", "lengths"),
    [
        ("dsv4", DSV4_UPSTREAM, range(1, 1101)),
        ("dsv4-both", DSV4, range(1, 1101)),
        ("gemma", GEMMA, range(500, 661)),
    ],
)
def test_rules_agree_with_the_simulator(simulated, layout, geo, lengths) -> None:  # noqa: ANN001
    slugs = [p.name for p in load_series(REPO).patches]
    on_base = Expectations(geo, [])
    overlaid = Expectations(geo, slugs)
    base_wrong = set(simulated[("base", layout)].wrong_lengths)
    over_wrong = set(simulated[("overlay", layout)].wrong_lengths)
    assert {n for n in lengths if on_base.verdict(n).base} == base_wrong
    assert {n for n in lengths if overlaid.verdict(n).overlay} == over_wrong, (
        "the overlay's wrong lengths changed: if a patch now fixes a rule, set "
        "that rule's fixed_by in vllm_overlay/e2e/expect.py"
    )


def test_refusals_agree_with_the_simulator(simulated) -> None:  # noqa: ANN001
    # The start-up verdicts the dry run reads (basestarts.RECORDED) are the
    # simulator's on the pinned base, and the series starts the layout.
    said = simulated[("base", HYBRID_PROBE)].refused_at_start or ""
    now = BaseStarts(load_pin(REPO / PIN_FILE).vllm.version, {HYBRID_PROBE: said})
    assert now == RECORDED, (
        "the pinned base's start-up verdicts changed: in vllm_overlay/e2e/"
        f"basestarts.py set RECORDED = {now!r}"
    )
    assert simulated[("overlay", HYBRID_PROBE)].refused_at_start is None
    glm = Geometry.of(load_config(EXAMPLES / "glm-5.3-flash-1p1d.toml"))
    slugs = [p.name for p in load_series(REPO).patches]
    assert bool(Expectations(glm, []).refusals) == bool(said)
    assert Expectations(glm, slugs).refused_overlaid == []


# A base whose connector refuses the probe (vLLM 0.33.0's words).
REFUSING = BaseStarts(
    "0.33.0",
    {
        HYBRID_PROBE: "ValueError: MoRIIO hybrid READ requires exactly one "
        "transferable attention group, got 2"
    },
)


def test_a_base_that_refuses_the_probe_refuses_every_mechanism_it_has() -> None:
    glm = Geometry.of(load_config(EXAMPLES / "glm-5.3-flash-1p1d.toml"))
    exp = Expectations(glm, [], REFUSING)
    ids = [r.id for r in exp.refusals]
    assert ids == ["hybrid-attention-groups", "hybrid-speculation", "unsupported-spec"]
    for r in exp.refusals:
        assert "got 2" in r.summary and "vLLM 0.33.0" in r.summary, r.summary
    slugs = [p.name for p in load_series(REPO).patches]
    assert Expectations(glm, slugs, REFUSING).refused_overlaid == []
    # Kimi (one group, DSpark, no ring) has none of the probe's mechanisms.
    kimi = Geometry.of(load_config(EXAMPLES / "kimi-k3-1p1d.toml"))
    assert Expectations(kimi, [], REFUSING).refusals == []
    assert Expectations(glm, [], BaseStarts("x", {HYBRID_PROBE: ""})).refusals == []


def test_dsv4_sweep_holds_every_failing_class_and_the_seed_lengths() -> None:
    config = load_config(EXAMPLES / "dsv4-pro-1p1d.toml")
    lengths = sweep_lengths(DSV4, config.checks)
    assert set(SEED_001) <= set(lengths)
    exp = Expectations(DSV4, [])
    # Every residue (N-1) % 64 of the lookahead class, and the one below it.
    residues = {(n - 1) % 64 for n in lengths if exp.verdict(n).base}
    assert set(range(55, 64)) <= residues
    assert any((n - 1) % 64 == 54 and n > 192 for n in lengths)
    # Every seed length fails on the base, none with the series; below 0008
    # the window-start lengths still do: 447 and 895 read the null block, 384
    # and 832 pair it on both legs.
    assert all(exp.verdict(n).base for n in SEED_001)
    slugs = [p.name for p in load_series(REPO).patches]
    still = [n for n in SEED_001 if Expectations(DSV4, slugs).verdict(n).overlay]
    assert still == []
    below = [s for s in slugs if patch_slug(s) != WINDOW_START]
    still = [n for n in SEED_001 if Expectations(DSV4, below).verdict(n).overlay]
    assert still == [384, 447, 832, 895]


def test_sweep_boundaries_and_minimum() -> None:
    checks = Checks(sweep_max_len=4096, sweep_min_count=100)
    kimi = Geometry(1536, 8, 0, 1536, True, 1, 1, 1, ("dspark",))
    lengths = sweep_lengths(kimi, Checks(sweep_max_len=98304, sweep_min_count=60))
    assert len(lengths) >= 60
    # Hybrid READ prefills N-1 tokens: boundaries of N-1 are in too.
    assert {12287, 12288, 12289, 12290, 12291} <= set(lengths)
    llama = Geometry(16, 1, 0, 16, False, 1, 0, 0, ())
    lengths = sweep_lengths(llama, checks)
    assert {15, 16, 17, 18, 4095, 4096} <= set(lengths)
    assert lengths == sorted(set(lengths))


def test_prefix_read_pages() -> None:
    kimi = Geometry.of(load_config(EXAMPLES / "kimi-k3-1p1d.toml"))
    r = prefix_read(kimi, 98304, int(98304 * 0.897))
    assert (r.local_hit, r.external, r.pages_base, r.pages_overlay) == (
        86016, 12287, 8, 1,
    )  # fmt: skip
    llama = Geometry(16, 1, 0, 16, False, 1, 0, 0, ())
    r = prefix_read(llama, 4096, 2048)
    assert r.pages_base == r.pages_overlay == 256  # issue 14: re-read on both


def dry_run(path, capsys) -> str:  # noqa: ANN001
    assert main(["e2e", "--config", str(path), "--dry-run"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("path", ALL_EXAMPLES, ids=lambda p: p.stem)
def test_every_example_plans_and_states_its_base_verdict(path, capsys) -> None:  # noqa: ANN001
    out = dry_run(path, capsys)
    assert "expected on the base image" in out
    assert "expected with the overlay (series " in out


def test_dsv4_dry_run_names_the_failing_lengths(capsys) -> None:  # noqa: ANN001
    out = dry_run(EXAMPLES / "dsv4-pro-1p1d.toml", capsys)
    line = next(x for x in out.splitlines() if "expected on the base image" in x)
    assert "lengths read wrong KV" in line
    shift = out.split("  lookahead-shift [")[1]
    assert shift.startswith("(N-1) % 64 >= 55 and N + 9 > 192")
    assert f"fixed by {TRIM_BEFORE_CLIP}" in shift
    listed = shift.split("lengths: ")[1].split("\n")[0].split()
    assert {str(n) for n in SEED_001} <= set(listed)
    start = out.split("  window-start [")[1]
    assert start.startswith("(N - 128 + 1) % 64 == 0")
    assert f"fixed by {WINDOW_START}" in start
    over = next(x for x in out.splitlines() if "expected with the overlay" in x)
    assert "window-start" not in over


def test_glm_dry_run_says_what_the_pinned_base_does_at_start(
    capsys,
    monkeypatch,  # noqa: ANN001
) -> None:
    path = EXAMPLES / "glm-5.3-flash-1p1d.toml"
    out = dry_run(path, capsys)
    if RECORDED.refusal(HYBRID_PROBE):
        assert "the servers refuse to start, so every check fails" in out
    else:
        assert "refuse to start" not in out
        assert (
            "expected on the base image: no length fails; vLLM "
            f"{RECORDED.vllm}'s connector starts this hybrid READ layout" in out
        )
    # On a base that refuses the probe, the dry run says so in its words.
    monkeypatch.setattr(basestarts, "RECORDED", REFUSING)
    out = dry_run(path, capsys)
    assert (
        "expected on the base image (vLLM 0.33.0 without the series): the "
        "servers refuse to start, so every check fails" in out
    )
    assert "requires exactly one transferable attention group, got 2" in out
    assert "method='mtp' speculative decoding: refused at start (" in out
    assert f"; fixed by {HYBRID_GROUPS}" in out
    assert "a CircularBufferSpec group: the servers fail closed at start" in out
    assert f"fixed by {RINGS}" in out
    over = next(x for x in out.splitlines() if "expected with the overlay" in x)
    assert "still refused" not in over


def test_kimi_dry_run_gives_pages_per_prefix_hit(capsys) -> None:  # noqa: ANN001
    out = dry_run(EXAMPLES / "kimi-k3-1p1d.toml", capsys)
    assert "page 1536 x dcp 8, hybrid READ" in out
    assert "sharing 89.7%: the decoder holds 86016 tokens, loads 12287" in out
    assert "reads 8 attention pages per group, the series 1" in out


def test_llama_is_a_smoke_test(capsys) -> None:  # noqa: ANN001
    out = dry_run(EXAMPLES / "llama-smoke.toml", capsys)
    assert "no length fails; this layout has none of the mechanisms" in out


def test_unequal_lookahead_on_the_prefill_side_is_not_modelled() -> None:
    # The simulator checked none and the same on both legs; a prefill tail
    # longer or shorter than the decoder's is not guessed at.
    for prefill in (3, 12):
        exp = Expectations(dataclasses.replace(DSV4, prefill_lookahead=prefill), [])
        assert exp.rules == []
        assert f"{prefill} lookahead slots on the prefill servers" in exp.not_modelled
    assert Expectations(DSV4, []).not_modelled == ""
