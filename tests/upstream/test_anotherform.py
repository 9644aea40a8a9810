"""The rule that a patch landed upstream in another form, and the upstream
change its header names."""

from __future__ import annotations

import pytest

from vllm_overlay.series.patch_series import PatchHeader
from vllm_overlay.upstream.rebase.anotherform import (
    evidence,
    landed_in_another_form,
    upstream_change,
)
from vllm_overlay.upstream.rebase.report import HunkState

L: HunkState = "landed"
CH: HunkState = "changed upstream"
CA: HunkState = "still to carry"
X: HunkState = "conflicting"


@pytest.mark.parametrize(
    ("states", "verdict"),
    [
        pytest.param([L, CH, CA, X], True, id="two show it, one conflicts"),
        pytest.param([L, CA, CA, CA], True, id="one landed, the rest apply"),
        pytest.param([L, X], False, id="a tie is a conflict"),
        pytest.param([CH, CH, CH], False, id="nothing landed outright"),
        pytest.param([X, X, CA], False, id="a genuine conflict"),
        pytest.param([L, CH, X, X, X], False, id="more conflict"),
        pytest.param([], False, id="no hunk"),
    ],
)
def test_the_rule(states: list[HunkState], verdict: bool) -> None:
    assert landed_in_another_form(states) is verdict


def test_the_evidence_names_each_state_in_order() -> None:
    states: dict[int, HunkState] = {0: L, 1: X, 2: CA, 3: CH, 4: L}
    assert evidence({"c.py": states}) == (
        "c.py: #1 #5 landed; #4 changed upstream; #3 still to carry; #2 conflicting"
    )


def _header(**fields: str) -> PatchHeader:
    base = {
        "subject": "s",
        "description": "d",
        "origin": "vendor",
        "author": "a",
        "forwarded": "no",
        "applied_upstream": "",
        "remove_when": "never",
        "tests": ["t"],
    }
    return PatchHeader(**{**base, **fields})  # type: ignore[arg-type]


PR = "https://github.com/vllm-project/vllm/pull/60867"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        pytest.param({"forwarded": PR}, f"#60867 ({PR})", id="Forwarded"),
        pytest.param({"origin": f"upstream, {PR}"}, f"#60867 ({PR})", id="Origin"),
        pytest.param({"bug": f"{PR}/files"}, f"#60867 ({PR}/files)", id="Bug"),
        pytest.param(
            {"bug": "https://example.org/issue/4"},
            "https://example.org/issue/4",
            id="a URL that is no pull request",
        ),
        pytest.param({}, "", id="none"),
    ],
)
def test_the_upstream_change_the_header_names(
    fields: dict[str, str], named: str
) -> None:
    assert upstream_change(_header(**fields)) == named
