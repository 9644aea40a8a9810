"""The byte-level sweep's plan: which (hit, length) cases each configuration
runs. Every configuration runs every prompt length; the configurations that
run each length at one hit, in turn, still run every (length, hit) case
between them."""

from __future__ import annotations

import contextlib
import itertools

from vllm_overlay.simulate.bytes.report import ConfigItem
from vllm_overlay.simulate.bytes.run import (
    DEFAULT_FAMILY_LENGTHS,
    DEFAULT_HITS,
    DEFAULT_LENGTHS,
    KV_LAYOUTS,
    MODES,
    plan_items,
)
from vllm_overlay.simulate.plan import parse_hits, parse_lengths

LENGTHS = parse_lengths(DEFAULT_LENGTHS)
FAMILY_LENGTHS = parse_lengths(DEFAULT_FAMILY_LENGTHS)
HITS = parse_hits(DEFAULT_HITS)


def _plan(layouts: list[str], all_hits: bool = False) -> list[ConfigItem]:
    return plan_items(
        layouts, list(MODES), None, list(KV_LAYOUTS), DEFAULT_FAMILY_LENGTHS, all_hits
    )


def _lengths(item: ConfigItem) -> list[int]:
    return FAMILY_LENGTHS if item.lengths is not None else LENGTHS


def test_the_whole_product_at_tp_1_1_and_with_dcp() -> None:
    items = _plan(["llama", "llama/dcp2", "kimi/dcp4"])
    full = [i for i in items if i.layout != "llama" or (i.p_tp, i.d_tp) == (1, 1)]
    assert {(i.layout, i.p_tp, i.d_tp) for i in full} == {
        ("llama", 1, 1),
        ("llama/dcp2", 2, 2),
        ("kimi/dcp4", 4, 4),
    }
    for item in full:
        assert item.hit_offset is None
        cases = item.cases(LENGTHS, HITS)
        assert sorted(cases) == sorted(itertools.product(HITS, LENGTHS))


def test_other_tp_pairs_run_every_length_once_and_every_case_between_them() -> None:
    for mode, kv_layout in itertools.product(MODES, KV_LAYOUTS):
        rotated = [
            i
            for i in _plan(["dsv4"])
            if i.mode == mode
            and i.kv_layout == kv_layout
            and (i.p_tp, i.d_tp) != (1, 1)
        ]
        assert {(i.p_tp, i.d_tp) for i in rotated} == {(2, 2), (1, 2), (2, 1)}
        union = []
        for item in rotated:
            cases = item.cases(LENGTHS, HITS)
            assert sorted(n for _, n in cases) == sorted(LENGTHS)
            # Hit by hit, as the whole product runs.
            assert [h for h, _ in cases] == sorted(h for h, _ in cases)
            union += cases
        assert sorted(union) == sorted(itertools.product(HITS, LENGTHS))


def test_a_family_runs_every_length_in_each_mode_at_shifted_hits() -> None:
    items = [i for i in _plan(["gemma3"]) if (i.p_tp, i.d_tp) == (1, 1)]
    assert [(i.mode, i.hit_offset) for i in items] == [("read", 0), ("write", 1)]
    per_mode = [set(i.cases(FAMILY_LENGTHS, HITS)) for i in items]
    for cases in per_mode:
        assert sorted(n for _, n in cases) == FAMILY_LENGTHS
        assert {h for h, _ in cases} == set(HITS)
    assert not per_mode[0] & per_mode[1]


def test_all_hits_runs_the_whole_product_everywhere() -> None:
    for item in _plan(["llama", "gemma3"], all_hits=True):
        assert item.hit_offset is None
        assert len(item.cases(_lengths(item), HITS)) == len(_lengths(item)) * len(HITS)


def test_the_command_rotates_by_default_and_not_with_all_hits(tmp_path, monkeypatch):
    from vllm_overlay.cli import main
    from vllm_overlay.simulate.bytes import cli

    planned: list[list[ConfigItem]] = []

    def capture(items, *_args, **_kwargs):
        planned.append(items)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "run_bytes_sweep", capture)
    argv = ["simulate-bytes", "--layouts", "llama", "--variant", "overlay"]
    argv += ["--report", str(tmp_path / "r.json")]
    for extra in ([], ["--all-hits"]):
        with contextlib.suppress(SystemExit):
            main([*argv, *extra])
    default, every = planned
    assert {i.hit_offset for i in default} == {None, 0, 1, 2}
    assert {i.hit_offset for i in every} == {None}


def test_a_bytes_option_without_bytes_is_one_line_and_runs_nothing(
    capsys, tmp_path, monkeypatch
):
    from vllm_overlay.cli import main
    from vllm_overlay.simulate import cli

    def started(*_args, **_kwargs):
        raise AssertionError("the scheduler simulator started")

    monkeypatch.setattr(cli, "run_sweep", started)
    report = tmp_path / "r.json"
    argv = ["simulate", "--layouts", "llama", "--report", str(report)]
    assert main([*argv, "--all-hits", "--tp", "2-1"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --tp, --all-hits: only with simulate-bytes\n"
    assert not report.exists()


def test_a_family_with_dcp_rotates_like_the_family() -> None:
    items = _plan(["kimi-k3/dcp2"])
    assert [(i.mode, i.p_tp, i.d_tp, i.hit_offset) for i in items] == [
        ("read", 2, 2, 0),
        ("write", 2, 2, 1),
    ]
