"""A manifest that is missing, unreadable or out of date is repaired by
`apply` whenever the bytes are a known state, and reported plainly by
`status`; an install overlaid by a shorter series is stale, not partial.
Issue 15's defect groups 1 and 6.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faketree import CONNECTOR, FakeTree, patch_text
from tests.workspace import make_diff
from vllm_overlay.series.patch_series import load_series
from vllm_overlay.series.pin import PIN_FILE, load_pin
from vllm_overlay.tree.manifest import MANIFEST_NAME
from vllm_overlay.tree.status import StatusReport, tree_status
from vllm_overlay.tree.target import detect_target


def _report(tree: FakeTree) -> StatusReport:
    pin, series = load_pin(tree.repo / PIN_FILE), load_series(tree.repo)
    report, _ = tree_status(detect_target(tree.vllm), pin, series)
    return report


def _append_patch(tree: FakeTree) -> None:
    """0003: one more change to the connector, on top of 0002."""
    text = (tree.site / CONNECTOR).read_text()
    assert "# 0002\n" in text  # the tree holds 0001 and 0002
    new = text.replace("connector line 35\n", "connector line 35\n# 0003\n")
    name = "0003-more.patch"
    (tree.repo / "patches" / name).write_text(
        patch_text(name, [make_diff(CONNECTOR, text, new)])
    )
    with (tree.repo / "patches" / "series").open("a") as f:
        f.write(name + "\n")


def _reference(tmp_path: Path, extra_patch: bool) -> dict[str, tuple[bytes, int]]:
    """The overlay a clean apply of the (longer) series gives."""
    ref = FakeTree.create(tmp_path / "reference")
    assert ref.cli("apply") == 0
    if extra_patch:
        _append_patch(ref)
        assert ref.cli("apply") == 0
    return ref.snapshot()


def test_missing_manifest_on_an_overlay_is_reported_and_rewritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect 1: a kill between the last file and the manifest used to leave
    an overlay without a manifest that `apply` called "already overlaid"."""
    tree = FakeTree.create(tmp_path / "t")
    assert tree.cli("apply") == 0
    overlaid = tree.snapshot()
    (tree.module / MANIFEST_NAME).unlink()
    report = _report(tree)
    assert (report.state, report.manifest) == ("overlaid", "missing")
    assert "the manifest is missing: apply rewrites it" in report.notes
    capsys.readouterr()
    assert tree.cli("status") == 1
    assert tree.cli("apply") == 0
    assert "rewrote the manifest (it was missing)" in capsys.readouterr().out
    assert tree.snapshot() == overlaid
    assert tree.cli("status") == 0


def test_missing_manifest_and_a_changed_series_still_apply_and_revert(
    tmp_path: Path,
) -> None:
    """Defect 1, continued: once the series changed, status said unknown and
    both apply and revert refused; now the bytes are peeled to the base."""
    expected = _reference(tmp_path, extra_patch=True)
    for command in ("apply", "revert"):
        tree = FakeTree.create(tmp_path / command)
        base = tree.snapshot()
        assert tree.cli("apply") == 0
        (tree.module / MANIFEST_NAME).unlink()
        _append_patch(tree)
        assert _report(tree).state == "partial"
        assert tree.cli(command) == 0
        assert tree.snapshot() == (expected if command == "apply" else base)


@pytest.mark.parametrize("garbage", [b"", b"{not json", b'{"series_id": 1}'])
def test_unreadable_manifest_is_reported_and_rewritten(
    tmp_path: Path, garbage: bytes
) -> None:
    tree = FakeTree.create(tmp_path / "t")
    assert tree.cli("apply") == 0
    overlaid = tree.snapshot()
    (tree.module / MANIFEST_NAME).write_bytes(garbage)
    report = _report(tree)
    assert report.state == "overlaid"
    assert report.manifest.startswith("invalid: not a manifest")
    assert tree.cli("apply") == 0
    assert tree.snapshot() == overlaid


def test_manifest_on_a_base_tree_is_removed_by_revert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest disagrees with the bytes: it records an overlay on files
    that are the base."""
    tree = FakeTree.create(tmp_path / "t")
    base = tree.snapshot()
    assert tree.cli("apply") == 0
    manifest = (tree.module / MANIFEST_NAME).read_bytes()
    assert tree.cli("revert") == 0
    (tree.module / MANIFEST_NAME).write_bytes(manifest)
    report = _report(tree)
    assert report.state == "base"
    assert report.manifest.startswith("stale: records series")
    capsys.readouterr()
    assert tree.cli("status") == 1
    assert "apply --revert removes it" in capsys.readouterr().out
    assert tree.cli("revert") == 0
    assert tree.snapshot() == base


def test_shorter_series_overlay_is_stale_and_reapplied(tmp_path: Path) -> None:
    """Defect 6: after a patch is appended to the series, an install
    overlaid by the shorter one is `stale` (as the README says) and `apply`
    brings it to the longer series."""
    expected = _reference(tmp_path, extra_patch=True)
    tree = FakeTree.create(tmp_path / "t")
    assert tree.cli("apply") == 0
    _append_patch(tree)
    report = _report(tree)
    assert report.state == "stale"
    by_path = {f.path: f.state for f in report.files}
    assert by_path[CONNECTOR] == "stale"
    assert tree.cli("apply") == 0
    assert tree.snapshot() == expected
    assert _report(tree).clean


def test_empty_series_on_an_overlay_is_a_revert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 41: every patch gone from the series (landed upstream, say):
    `apply` restores the pinned base and removes the manifest, which used to
    stay and record the old series ("already overlaid" ever after)."""
    tree = FakeTree.create(tmp_path / "t")
    base = tree.snapshot()
    assert tree.cli("apply") == 0
    for patch in (tree.repo / "patches").glob("*.patch"):
        patch.unlink()
    (tree.repo / "patches" / "series").write_text("# every patch landed\n")
    capsys.readouterr()
    assert tree.cli("apply") == 0
    out = capsys.readouterr().out
    assert out.endswith("apply: the series is empty: restored the pinned base\n")
    assert tree.snapshot() == base
    assert not (tree.module / MANIFEST_NAME).exists()
    assert tree.cli("status") == 0
    assert tree.cli("apply") == 0
    assert capsys.readouterr().out.endswith(
        "apply: the series is empty: already the pinned base\n"
    )
    assert tree.snapshot() == base
