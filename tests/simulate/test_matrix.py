"""The README's supported-models table is the generator's output."""

from __future__ import annotations

from pathlib import Path

from vllm_overlay.simulate.families import family_layouts
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.simulate.matrix import (
    MATRIX_JSON,
    current_section,
    load_matrix,
    readme_section,
)

REPO = Path(__file__).resolve().parents[2]


def test_readme_table_is_generated_from_the_committed_matrix():
    report = load_matrix(REPO / MATRIX_JSON)
    readme = (REPO / "README.md").read_text()
    assert current_section(readme) == readme_section(report), (
        "README.md's supported-models table is stale: run "
        "`vllm-overlay simulate --update-readme`"
    )


def test_committed_matrix_covers_every_family_layout_base_and_overlay():
    report = load_matrix(REPO / MATRIX_JSON)
    rows = {(r.layout, r.variant) for r in report.layouts}
    names = [layout.name for layout in expand(list(family_layouts()))]
    expected = {(name, v) for name in names for v in ("base", "overlay")}
    assert rows == expected, (
        "docs/supported-models.json does not match the family layouts: run "
        "`vllm-overlay simulate --update-readme`"
    )


def test_the_readme_gives_each_refusal_whole():
    """A refusal's end often says what to do ("Padding is only supported for
    non-MLA attention layers", "Pass --disable-hybrid-kv-cache-manager"): the
    table gives the whole message, never cut at "..."."""
    report = load_matrix(REPO / MATRIX_JSON)
    section = readme_section(report)
    refusals = [r.refused_at_start for r in report.layouts if r.refused_at_start]
    assert refusals
    for text in refusals:
        assert " ".join(text.split()).replace("|", "\\|") in section, text


def test_base_is_named_by_its_pin_not_by_a_path():
    """The README quotes the sweep's base: the pinned version and commit, and
    whether the files came from a wheel or the installed package, never a
    directory of the machine that ran it."""
    from vllm_overlay.checkout import Checkout
    from vllm_overlay.simulate.plan import base_files

    _, where = base_files()
    vllm = Checkout.find().pin.vllm
    assert where.startswith(f"vLLM {vllm.version} ({vllm.git_commit}, ")
    assert "/" not in where
