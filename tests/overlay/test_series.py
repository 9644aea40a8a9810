"""series check: the series file, the headers, the diffs."""

from __future__ import annotations

import pytest

from tests.overlay.workspace import ANCHOR, CONNECTOR, Workspace, header, replace_once
from vllm_overlay.cli import main
from vllm_overlay.series.patch_series import SeriesError, check_series, load_series
from vllm_overlay.series.pin import load_pin


def _edit(tag: str):
    return lambda t: replace_once(t, ANCHOR, f"# {tag}\n{ANCHOR}")


def _problems(ws: Workspace) -> list[str]:
    return check_series(ws.repo, load_pin(ws.repo / "pin.toml"))


def test_sound_series_passes(ws: Workspace, capsys) -> None:
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _edit("a"))
    assert _problems(ws) == []
    assert main(["--repo", str(ws.repo), "series", "check"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("series check: ok, 1 patches")


def test_missing_patch_file(ws: Workspace) -> None:
    (ws.repo / "patches" / "series").write_text("0001-gone.patch\n")
    assert _problems(ws) == [
        f"series lists 0001-gone.patch, but {ws.repo}/patches/0001-gone.patch "
        "does not exist"
    ]


def test_unlisted_patch_file(ws: Workspace) -> None:
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _edit("a"))
    ws.add_patch("0002-stray.patch", "anything", listed=False)
    assert _problems(ws) == [
        "0002-stray.patch is in patches/ but not listed in the series"
    ]


def test_duplicate_entry(ws: Workspace) -> None:
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _edit("a"))
    with (ws.repo / "patches" / "series").open("a") as f:
        f.write("0001-a.patch  # again\n")
    assert "series lists 0001-a.patch more than once" in _problems(ws)


@pytest.mark.parametrize("field", ["Forwarded", "Tests", "Subject", "Remove-When"])
def test_header_without_required_field(ws: Workspace, field: str) -> None:
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _edit("a"))
    text = (ws.repo / "patches" / "0001-a.patch").read_text()
    _, body = text.split("---\n", 1)
    broken = header("0001-a.patch", **{field: None}) + "---\n" + body
    (ws.repo / "patches" / "0001-a.patch").write_text(broken)
    problems = _problems(ws)
    assert problems == [f"0001-a.patch: header lacks {field}"]


def test_forwarded_must_be_url_or_not_yet(ws: Workspace) -> None:
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _edit("a"))
    path = ws.repo / "patches" / "0001-a.patch"
    path.write_text(path.read_text().replace("Forwarded: not yet", "Forwarded: maybe"))
    assert _problems(ws) == [
        "0001-a.patch: Forwarded must be a URL or 'not yet', got 'maybe'"
    ]


def test_tests_must_exist(ws: Workspace) -> None:
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _edit("a"))
    path = ws.repo / "patches" / "0001-a.patch"
    path.write_text(
        path.read_text().replace(
            "Tests: tests/overlay/conftest.py", "Tests: tests/nowhere.py::test_x"
        )
    )
    assert _problems(ws) == [
        "0001-a.patch: Tests names tests/nowhere.py::test_x, but tests/nowhere.py "
        "is missing"
    ]


def test_unpinned_file_and_bad_diff(ws: Workspace) -> None:
    ws.add_patch(
        "0001-a.patch",
        header("a")
        + "---\n--- a/vllm/other.py\n+++ b/vllm/other.py\n@@ -1 +1 @@\n-x\n+y\n",
    )
    ws.add_patch("0002-b.patch", header("b") + "---\nnot a diff at all\n")
    assert _problems(ws) == [
        "0001-a.patch: touches vllm/other.py, which is not pinned",
        "0002-b.patch: not a unified diff: no file diffs found",
    ]


def test_load_series_reads_header(ws: Workspace) -> None:
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _edit("a"))
    series = load_series(ws.repo)
    (patch,) = series.patches
    assert patch.header.description == "0001-a.patch.\nA second line."
    assert patch.header.tests == ["tests/overlay/conftest.py"]
    assert [f.path for f in patch.files] == [CONNECTOR]
    assert len(series.series_id) == 12


def test_cli_error_is_one_line(ws: Workspace, capsys) -> None:
    (ws.repo / "patches" / "series").write_text("0001-gone.patch\n")
    code = main(["--repo", str(ws.repo), "apply", "--target", str(ws.vllm)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: series lists 0001-gone")


def test_load_series_refuses_missing(ws: Workspace) -> None:
    (ws.repo / "patches" / "series").write_text("0001-gone.patch\n")
    with pytest.raises(SeriesError):
        load_series(ws.repo)
