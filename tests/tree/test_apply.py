"""apply / revert on a real copy of the pinned base: exact, all or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workspace import ANCHOR, COMMON, CONNECTOR, Workspace, replace_once
from vllm_overlay import transaction
from vllm_overlay.series.patch_series import load_series
from vllm_overlay.series.pin import load_pin
from vllm_overlay.tree.apply import ApplyError, apply_series, revert_series
from vllm_overlay.tree.manifest import MANIFEST_NAME
from vllm_overlay.tree.status import tree_status
from vllm_overlay.tree.target import detect_target


def _mark(tag: str):
    return lambda text: replace_once(text, ANCHOR, f"# {tag}\n{ANCHOR}")


def _run(ws: Workspace, revert: bool = False):
    pin = load_pin(ws.repo / "pin.toml")
    series = load_series(ws.repo)
    fn = revert_series if revert else apply_series
    return fn(detect_target(ws.vllm), pin, series)


def _two_patch_series(ws: Workspace) -> None:
    after_first = ws.patch_from_edit("0001-a.patch", CONNECTOR, _mark("first"))
    ws.patch_from_edit("0002-b.patch", CONNECTOR, _mark("second"), on=after_first)
    ws.patch_from_edit(
        "0003-c.patch",
        COMMON,
        lambda t: replace_once(
            t,
            "class MoRIIOError(Exception):\n",
            "class MoRIIOError(Exception):\n    # c\n",
        ),
    )


def test_apply_then_revert_restores_every_byte(ws: Workspace) -> None:
    _two_patch_series(ws)
    before = ws.snapshot()
    outcome = _run(ws)
    assert outcome.action == "applied"
    assert sorted(outcome.files) == [COMMON, CONNECTOR]
    text = (ws.site / CONNECTOR).read_text()
    assert "# first\n# second\n" + ANCHOR in text
    assert (ws.site / Path(CONNECTOR).parent / MANIFEST_NAME).is_file()
    assert _run(ws, revert=True).action == "reverted"
    assert ws.snapshot() == before


def test_reapply_is_a_noop(ws: Workspace) -> None:
    _two_patch_series(ws)
    _run(ws)
    overlaid = ws.snapshot()
    outcome = _run(ws)
    assert outcome.action == "no-op"
    assert "already overlaid" in outcome.message
    assert ws.snapshot() == overlaid


def test_failing_second_patch_leaves_target_unchanged(ws: Workspace) -> None:
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _mark("first"))
    # Made against a base that does not exist: one context line differs.
    ws.patch_from_edit(
        "0002-b.patch",
        COMMON,
        lambda t: replace_once(
            t,
            "class MoRIIOError(Exception):\n",
            "class MoRIIOError(Exception):\n    # x\n",
        ),
        on=replace_once(
            ws.base[COMMON],
            '    """Base exception for MoRIIO operations."""\n',
            '    """Base exception (drifted)."""\n',
        ),
    )
    before = ws.snapshot()
    with pytest.raises(ApplyError, match="0002-b.patch"):
        _run(ws)
    assert ws.snapshot() == before


@pytest.mark.parametrize("phase", ["temp-write", "rename"])
def test_write_failure_rolls_back(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    """A permission error on the second file, in either write phase, leaves
    the target byte-identical (injected: the suite runs as root, which file
    modes do not stop)."""
    _two_patch_series(ws)
    before = ws.snapshot()
    calls = {"n": 0}
    step = "write " if phase == "temp-write" else "rename "

    def flaky(name: str) -> None:
        if not name.startswith(step) or name == "write journal":
            return
        calls["n"] += 1
        if calls["n"] == 2:
            raise PermissionError(13, "Permission denied", name.split(" ", 1)[1])

    monkeypatch.setattr(transaction, "_fault_hook", flaky)
    with pytest.raises(ApplyError, match="Permission denied"):
        _run(ws)
    assert calls["n"] == 2
    assert ws.snapshot() == before


def test_edited_base_is_refused_with_both_hashes(ws: Workspace) -> None:
    _two_patch_series(ws)
    target = ws.site / COMMON
    data = bytearray(target.read_bytes())
    data[100] ^= 0x01
    target.write_bytes(bytes(data))
    before = ws.snapshot()
    pin = load_pin(ws.repo / "pin.toml")
    with pytest.raises(ApplyError) as exc:
        _run(ws)
    message = str(exc.value)
    assert pin.files[COMMON] in message
    import hashlib

    assert hashlib.sha256(bytes(data)).hexdigest() in message
    assert "\n" not in message
    assert ws.snapshot() == before


def test_drifted_context_is_refused_not_fuzzed(ws: Workspace) -> None:
    # The patch's hunk sits one line lower than the real anchor: a patch tool
    # with offsets or fuzz would apply it; this one must not.
    shifted = "\n" + ws.base[CONNECTOR]
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _mark("first"), on=shifted)
    before = ws.snapshot()
    with pytest.raises(ApplyError, match="offsets are not accepted"):
        _run(ws)
    assert ws.snapshot() == before


def test_revert_of_base_is_a_noop(ws: Workspace) -> None:
    _two_patch_series(ws)
    before = ws.snapshot()
    assert _run(ws, revert=True).action == "no-op"
    assert ws.snapshot() == before


def test_stale_overlay_is_replaced_by_the_new_series(ws: Workspace) -> None:
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _mark("old"))
    _run(ws)
    # The series changes under an overlaid tree (a reused venv).
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _mark("new"), on=None)
    (ws.repo / "patches" / "series").write_text("0001-a.patch\n")
    pin = load_pin(ws.repo / "pin.toml")
    report, _ = tree_status(detect_target(ws.vllm), pin, load_series(ws.repo))
    assert report.state == "stale"
    outcome = _run(ws)
    assert "stale" in outcome.message
    text = (ws.site / CONNECTOR).read_text()
    assert "# new\n" + ANCHOR in text and "# old\n" not in text
    _run(ws, revert=True)
    assert (ws.site / CONNECTOR).read_text() == ws.base[CONNECTOR]


def test_source_root_is_a_target(ws: Workspace) -> None:
    (ws.site / "pyproject.toml").write_text("[project]\nname='vllm'\n")
    _two_patch_series(ws)
    target = detect_target(ws.site)
    assert target.kind == "source"
    pin = load_pin(ws.repo / "pin.toml")
    assert apply_series(target, pin, load_series(ws.repo)).action == "applied"
