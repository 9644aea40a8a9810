"""status tells base, overlaid, partial and unknown apart."""

from __future__ import annotations

import json

from tests.repo import REPO
from tests.workspace import ANCHOR, CONNECTOR, Workspace, replace_once
from vllm_overlay.cli import main
from vllm_overlay.series.patch_series import load_series
from vllm_overlay.series.pin import load_pin
from vllm_overlay.tree.materialize import base_from_target
from vllm_overlay.tree.status import tree_status
from vllm_overlay.tree.target import detect_target, installed_vllm


def _state(ws: Workspace):
    pin = load_pin(ws.repo / "pin.toml")
    report, _ = tree_status(detect_target(ws.vllm), pin, load_series(ws.repo))
    return report


def _series(ws: Workspace) -> str:
    first = ws.patch_from_edit(
        "0001-a.patch", CONNECTOR, lambda t: replace_once(t, ANCHOR, "# a\n" + ANCHOR)
    )
    return ws.patch_from_edit(
        "0002-b.patch",
        CONNECTOR,
        lambda t: replace_once(t, ANCHOR, "# b\n" + ANCHOR),
        on=first,
        own_tests=True,
    )


def test_base_tree(ws: Workspace) -> None:
    _series(ws)
    report = _state(ws)
    assert report.state == "base"
    assert {f.state for f in report.files} == {"base"}
    assert len(report.files) == len(load_pin(ws.repo / "pin.toml").files)


def test_overlaid_tree_names_the_patches(ws: Workspace, capsys) -> None:
    _series(ws)
    assert main(["--repo", str(ws.repo), "apply", "--target", str(ws.vllm)]) == 0
    report = _state(ws)
    assert report.state == "overlaid"
    by_path = {f.path: f for f in report.files}
    assert by_path[CONNECTOR].patches == ["0001-a.patch", "0002-b.patch"]
    capsys.readouterr()
    code = main(["--repo", str(ws.repo), "status", "--target", str(ws.vllm), "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["state"] == "overlaid"


def test_partial_tree(ws: Workspace) -> None:
    after_both = _series(ws)
    first_only = replace_once(ws.base[CONNECTOR], ANCHOR, "# a\n" + ANCHOR)
    assert first_only != after_both
    (ws.site / CONNECTOR).write_text(first_only)
    report = _state(ws)
    assert report.state == "partial"
    by_path = {f.path: f for f in report.files}
    assert by_path[CONNECTOR].state == "partial"
    assert by_path[CONNECTOR].patches == ["0001-a.patch"]
    assert main(["--repo", str(ws.repo), "status", "--target", str(ws.vllm)]) == 1


def test_unknown_file_shows_expected_and_actual(ws: Workspace, capsys) -> None:
    _series(ws)
    (ws.site / CONNECTOR).write_text(ws.base[CONNECTOR] + "# local edit\n")
    report = _state(ws)
    assert report.state == "unknown"
    code = main(["--repo", str(ws.repo), "status", "--target", str(ws.vllm)])
    out = capsys.readouterr().out
    assert code == 1
    pin = load_pin(ws.repo / "pin.toml")
    assert pin.files[CONNECTOR] in out
    assert "actual" in out and "unknown" in out


def test_unpinned_file_in_module_is_drift(ws: Workspace) -> None:
    _series(ws)
    (ws.site / CONNECTOR).with_name("moriio_extra.py").write_text("x = 1\n")
    report = _state(ws)
    assert report.state == "unknown"
    assert any(f.detail == "not in the pin" for f in report.files)


def test_require_overlaid_fails_on_base(ws: Workspace) -> None:
    _series(ws)
    args = ["--repo", str(ws.repo), "status", "--target", str(ws.vllm)]
    assert main([*args, "--require", "overlaid"]) == 1
    assert main([*args, "--require", "base"]) == 0


def test_a_failed_require_says_why(ws: Workspace, capsys) -> None:
    _series(ws)
    args = ["--repo", str(ws.repo), "status", "--target", str(ws.vllm)]
    assert main([*args, "--require", "overlaid"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "status: --require overlaid, but the tree is base"


def test_status_takes_what_materialize_wrote(ws: Workspace, tmp_path, capsys) -> None:
    """`materialize --out DIR` writes only the MoRIIO module below DIR/vllm:
    status and apply take DIR or DIR/vllm as the target."""
    _series(ws)
    out = tmp_path / "stack"
    repo = ["--repo", str(ws.repo)]
    assert main([*repo, "materialize", "--from", str(ws.vllm), "--out", str(out)]) == 0
    for target in (out, out / "vllm"):
        args = [*repo, "status", "--target", str(target)]
        assert main([*args, "--require", "overlaid"]) == 0, target
        assert "(MoRIIO files only)" in capsys.readouterr().out
    base = tmp_path / "base"
    assert (
        main(
            [*repo, "materialize", "--base", "--from", str(ws.vllm), "--out", str(base)]
        )
        == 0
    )
    assert main([*repo, "status", "--target", str(base), "--require", "base"]) == 0
    assert main([*repo, "apply", "--target", str(base)]) == 0
    assert main([*repo, "status", "--target", str(base), "--require", "overlaid"]) == 0
    capsys.readouterr()
    assert main([*repo, "status", "--target", str(tmp_path)]) == 2
    assert "materialize --out" in capsys.readouterr().err


def test_materialize_upto_names_the_patches_and_one_series_id(
    ws: Workspace, tmp_path, capsys
) -> None:
    """`--upto N` says which patches of which series it wrote; the stack's own
    series id (a different hash) is left to --json."""
    _series(ws)
    whole = load_series(ws.repo)
    repo = ["--repo", str(ws.repo), "materialize", "--from", str(ws.vllm)]
    assert main([*repo, "--upto", "1", "--out", str(tmp_path / "one")]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    stack_id = whole.upto(1).series_id
    assert f"overlaid by 1 patch 0001 of series {whole.series_id}," in last, last
    assert stack_id not in last
    assert main([*repo, "--upto", "2", "--out", str(tmp_path / "two")]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert f" files, overlaid by series {whole.series_id}," in last, last
    assert main([*repo, "--upto", "3", "--out", str(tmp_path / "three")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --upto 3: the series has patches 1..2 (0 for none); nothing was "
        "written\n"
    )
    assert not (tmp_path / "three").exists()


def test_the_base_files_the_tests_use_are_the_installed_trees_base(
    base_texts: dict[str, str],
) -> None:
    """tests/conftest.py takes them from the pinned wheel when the run has
    it: the same bytes the installed tree, base or overlaid, gives back."""
    pin = load_pin(REPO / "pin.toml")
    target = detect_target(installed_vllm())
    assert base_texts == base_from_target(target, pin, load_series(REPO))
