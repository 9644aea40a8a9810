"""series check on the core series (patches/core/): its names, headers and
pinned files, and a connector patch's Remove-When naming a core patch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workspace import ANCHOR, CONNECTOR, Workspace, header, make_diff
from vllm_overlay.cli import main
from vllm_overlay.series.core_series import (
    check_core_series,
    core_fix,
    find_core_patch,
    load_core_series,
)
from vllm_overlay.series.patch_series import SeriesError, load_series, parse_header
from vllm_overlay.series.pin import load_pin

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
SLUG = "c001-keep-loads-out-of-zeroing"


def _core_patch(ws: Workspace, name: str, path: str = SCHEDULER, **fields: str) -> None:
    core = ws.repo / "patches" / "core"
    core.mkdir(exist_ok=True)
    diff = make_diff(path, "a = 1\n", "a = 2\n")
    head = header(name, Tests=f"tests/conftest.py::test_{name[:4]}", **fields)
    (core / name).write_text(head + "---\n" + diff)
    with (core / "series").open("a") as f:
        f.write(name + "\n")


def _workaround(ws: Workspace, remove_when: str) -> None:
    new = ws.base[CONNECTOR].replace(ANCHOR, f"# w\n{ANCHOR}")
    diff = make_diff(CONNECTOR, ws.base[CONNECTOR], new)
    ws.add_patch(
        "0001-w.patch", header("w", **{"Remove-When": remove_when}) + "---\n" + diff
    )


def _problems(ws: Workspace) -> list[str]:
    repo = ws.repo
    return check_core_series(repo, load_pin(repo / "pin.toml"), load_series(repo))


def test_the_checkouts_core_series_is_sound(repo: Path) -> None:
    pin = load_pin(repo / "pin.toml")
    assert check_core_series(repo, pin, load_series(repo)) == []
    core = load_core_series(repo)
    keys = [p.name[:4] for p in core.patches]
    assert keys == ["c001", "c002", "c003", "c004", "c005", "c006", "c007"]
    assert all(f.path in pin.core_files for p in core.patches for f in p.files)


def test_the_zeroing_workaround_names_its_core_fix(repo: Path) -> None:
    patch = next(p for p in load_series(repo).patches if p.name.startswith("0010-"))
    assert core_fix(patch.header) == "c001"
    bundle = find_core_patch(load_core_series(repo), "c001").slug
    assert f"(bundle {bundle})" in patch.header.remove_when


def test_a_sound_core_series_is_said_by_series_check(ws: Workspace, capsys) -> None:
    _core_patch(ws, f"{SLUG}.patch")
    _workaround(ws, f"core patch c001 (bundle {SLUG}) is in vLLM")
    assert _problems(ws) == []
    assert main(["--repo", str(ws.repo), "series", "check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"core {SLUG}.patch" in out[-2] and "replaces 0001-w.patch" in out[-2]
    assert out[-1].endswith(", 1 core patch")


def test_no_core_series_is_no_problem(ws: Workspace) -> None:
    assert _problems(ws) == []
    assert load_core_series(ws.repo).patches == ()


@pytest.mark.parametrize(
    ("name", "path", "problem"),
    [
        ("fix.patch", SCHEDULER, "core: series entry 'fix.patch' is not named"),
        (f"{SLUG}.patch", "vllm/v1/core/block_pool.py", "does not pin"),
        (f"{SLUG}.patch", CONNECTOR, "does not pin"),
    ],
)
def test_a_bad_core_patch_is_one_line(
    ws: Workspace, name: str, path: str, problem: str
) -> None:
    _core_patch(ws, name, path)
    found = _problems(ws)
    assert len(found) == 1 and problem in found[0], found


def test_a_core_patch_not_listed_is_a_problem(ws: Workspace) -> None:
    _core_patch(ws, f"{SLUG}.patch")
    (ws.repo / "patches" / "core" / "c002-x.patch").write_text("")
    assert _problems(ws) == [
        "core: c002-x.patch is in patches/core/ but not listed in its series"
    ]


def test_remove_when_must_name_a_listed_core_patch_and_its_bundle(
    ws: Workspace,
) -> None:
    _core_patch(ws, f"{SLUG}.patch")
    _workaround(ws, "core patch c002 (bundle c002-x) is in vLLM")
    assert _problems(ws) == [
        "0001-w.patch: Remove-When names core patch c002, which "
        "patches/core/series does not list"
    ]


def test_remove_when_without_the_bundle_says_how_to_name_it(ws: Workspace) -> None:
    _core_patch(ws, f"{SLUG}.patch")
    _workaround(ws, "core patch c001 is in vLLM")
    assert _problems(ws) == [
        "0001-w.patch: Remove-When names core patch c001 without its bundle; "
        f"write 'core patch c001 (bundle {SLUG})'"
    ]


def test_an_unknown_core_patch_is_one_line(ws: Workspace) -> None:
    _core_patch(ws, f"{SLUG}.patch")
    with pytest.raises(SeriesError, match=r"^no core patch c009 .*holds c001\)$"):
        find_core_patch(load_core_series(ws.repo), "c009")


def test_core_fix_reads_the_remove_when() -> None:
    head = header("x", **{"Remove-When": "core patch c012 (bundle c012-y) lands"})
    assert core_fix(parse_header(head, "x")) == "c012"
    assert core_fix(parse_header(header("x"), "x")) is None
