"""The byte-level sweep's TP pairs for the model families: by default each
family layout runs TP 1->1 at its own lengths and one unequal pair, 1->2 and
2->1 alternating over the families, at a few lengths, in both modes;
``--family-tp all`` runs every family at every TP pair."""

from __future__ import annotations

import contextlib
import itertools

from vllm_overlay.simulate.bytes.report import ConfigItem
from vllm_overlay.simulate.bytes.run import (
    DEFAULT_FAMILY_LENGTHS,
    DEFAULT_FAMILY_TP_LENGTHS,
    DEFAULT_HITS,
    KV_LAYOUTS,
    MODES,
    TP_PAIRS,
    plan_items,
)
from vllm_overlay.simulate.layouts import all_layouts, expand
from vllm_overlay.simulate.plan import parse_hits, parse_lengths

FAMILIES = [name for name, layout in all_layouts().items() if layout.family]


def _plan(layouts: list[str], family_tp: str = "sample") -> list[ConfigItem]:
    return plan_items(
        layouts,
        list(MODES),
        None,
        list(KV_LAYOUTS),
        DEFAULT_FAMILY_LENGTHS,
        family_tp=family_tp,
        sample_lengths=DEFAULT_FAMILY_TP_LENGTHS,
    )


def _pairs(items: list[ConfigItem], layout: str, mode: str) -> list[tuple[int, int]]:
    return [(i.p_tp, i.d_tp) for i in items if i.layout == layout and i.mode == mode]


def test_every_family_of_the_default_sweep_runs_one_unequal_pair_per_mode() -> None:
    """The default sweep's layouts (``expand()``): a family layout that lost
    its unequal-TP row, in either mode, fails here."""
    default = [layout.name for layout in expand()]
    items = _plan(default)
    for name in FAMILIES:
        assert name in default, name
        for mode in MODES:
            pairs = _pairs(items, name, mode)
            assert pairs[0] == (1, 1), (name, mode, pairs)
            assert len(pairs) == 2 and pairs[1] in ((1, 2), (2, 1)), (name, pairs)
    # Both directions, alternating over the family layouts.
    unequal = [_pairs(items, name, "read")[1] for name in FAMILIES]
    assert unequal == [((1, 2), (2, 1))[i % 2] for i in range(len(FAMILIES))]


def test_the_unequal_pair_runs_its_lengths_each_at_one_hit_per_mode() -> None:
    lengths = parse_lengths(DEFAULT_FAMILY_TP_LENGTHS)
    hits = parse_hits(DEFAULT_HITS)
    rows = [i for i in _plan(FAMILIES[:2]) if i.p_tp != i.d_tp]
    assert [(i.layout, i.mode) for i in rows] == list(
        itertools.product(FAMILIES[:2], MODES)
    )
    for item in rows:
        assert item.lengths == DEFAULT_FAMILY_TP_LENGTHS
        cases = item.cases(lengths, hits)
        assert sorted(n for _, n in cases) == sorted(lengths)
        assert {h for h, _ in cases} == set(hits)
    read, write = (set(i.cases(lengths, hits)) for i in rows[:2])
    assert not read & write


def test_family_tp_all_runs_every_pair_at_the_familys_lengths() -> None:
    items = _plan(FAMILIES[:3], family_tp="all")
    for name, mode in itertools.product(FAMILIES[:3], MODES):
        assert _pairs(items, name, mode) == list(TP_PAIRS)
    assert {i.lengths for i in items} == {DEFAULT_FAMILY_LENGTHS}


def test_an_explicit_tp_runs_the_families_at_those_pairs_only() -> None:
    items = plan_items(
        FAMILIES[:2], ["read"], [(2, 1)], list(KV_LAYOUTS), DEFAULT_FAMILY_LENGTHS
    )
    assert {(i.p_tp, i.d_tp, i.lengths) for i in items} == {
        (2, 1, DEFAULT_FAMILY_LENGTHS)
    }


def test_the_command_samples_by_default_and_runs_all_with_the_flag(
    tmp_path, monkeypatch
):
    from vllm_overlay.cli import main
    from vllm_overlay.simulate.bytes import cli

    planned: list[list[ConfigItem]] = []

    def capture(items, *_args, **_kwargs):
        planned.append(items)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "run_bytes_sweep", capture)
    argv = ["simulate-bytes", "--layouts", "kimi-k3", "--variant", "overlay"]
    argv += ["--report", str(tmp_path / "r.json")]
    for extra in ([], ["--family-tp", "all"]):
        with contextlib.suppress(SystemExit):
            main([*argv, *extra])
    sample, every = planned
    assert {(i.p_tp, i.d_tp) for i in sample} == {(1, 1), (1, 2)}
    assert {(i.p_tp, i.d_tp) for i in every} == set(TP_PAIRS)
