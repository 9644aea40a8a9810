"""series check: the series file, the headers, the diffs."""

from __future__ import annotations

import pytest

from tests.workspace import ANCHOR, CONNECTOR, Workspace, header, replace_once
from vllm_overlay.cli import main
from vllm_overlay.series.patch_series import (
    REQUIRED_FIELDS,
    SeriesError,
    check_series,
    load_series,
    set_header_field,
)
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
    # One of each, said as one: not "1 patches", "1 tests".
    assert out[-1].startswith("series check: ok, 1 patch, series ")
    assert "; 1 test, 0 guards; " in out[0], out[0]


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


@pytest.mark.parametrize("field", REQUIRED_FIELDS)
def test_header_without_required_field(ws: Workspace, field: str) -> None:
    _with_header(ws, **{field: None})
    assert _problems(ws) == [f"0001-a.patch: header lacks {field}"]


def _with_header(ws: Workspace, name: str = "0001-a.patch", **fields: str | None):
    """A patch ``name`` whose header has ``fields`` changed (None: the field
    is left out). The check reads each diff; it does not apply the series."""
    ws.patch_from_edit(name, CONNECTOR, _edit(name))
    fields.setdefault("Tests", f"tests/conftest.py::test_{name[:4]}")
    path = ws.repo / "patches" / name
    _, body = path.read_text().split("---\n", 1)
    path.write_text(header(name, **fields) + "---\n" + body)


@pytest.mark.parametrize("value", ["not yet", "maybe", "yes", "upstream"])
def test_forwarded_must_be_a_dep3_value(ws: Workspace, value: str) -> None:
    _with_header(ws, Forwarded=value)
    assert _problems(ws) == [
        f"0001-a.patch: Forwarded: {value!r} is not a DEP-3 value (no, "
        "not-needed, or the URL the change was sent to)"
    ]


@pytest.mark.parametrize(
    "value", ["no", "not-needed", "https://github.com/vllm-project/vllm/pull/1"]
)
def test_forwarded_dep3_values_pass(ws: Workspace, value: str) -> None:
    _with_header(ws, Forwarded=value)
    assert _problems(ws) == []


@pytest.mark.parametrize(
    "origin",
    ["upstream", "upstream, pull request by someone", "backport, #62165"],
)
def test_upstream_origin_needs_a_url(ws: Workspace, origin: str) -> None:
    _with_header(ws, Origin=origin)
    category = origin.split(",")[0]
    assert _problems(ws) == [
        f"0001-a.patch: Origin: an {category} origin carries the URL of the "
        f"upstream change ('{category}, https://...'), got {origin!r}"
    ]


@pytest.mark.parametrize(
    "origin",
    [
        "upstream, https://github.com/vllm-project/vllm/pull/1",
        "backport, https://github.com/vllm-project/vllm/pull/1",
        "vendor",
        "other, https://example.org/list/1",
        "https://example.org/list/1",
    ],
)
def test_dep3_origins_pass(ws: Workspace, origin: str) -> None:
    _with_header(ws, Origin=origin)
    assert _problems(ws) == []


def test_origin_category_must_be_dep3(ws: Workspace) -> None:
    _with_header(ws, Origin="ours")
    assert _problems(ws) == [
        "0001-a.patch: Origin: 'ours' is neither a URL nor '<category>, <URL or "
        "commit>' (upstream, backport, vendor, other)"
    ]


def test_unknown_field_is_an_error(ws: Workspace) -> None:
    _with_header(ws, **{"X-Status": "carried"})
    assert _problems(ws) == [
        "0001-a.patch:10: unknown header field 'X-Status' (neither DEP-3 nor "
        "declared in README.md's patch headers)"
    ]


def test_declared_fields_pass_and_parse(ws: Workspace) -> None:
    url = "https://github.com/vllm-project/vllm/pull/1"
    _with_header(ws, Origin=f"upstream, {url}", Forwarded=url)
    _with_header(
        ws,
        "0002-b.patch",
        Guards="tests/conftest.py::test_a\n tests/conftest.py::c",
        **{"Builds-On": url, "Reviewed-by": "someone", "Bug": url},
    )
    assert _problems(ws) == []
    second = load_series(ws.repo).patches[1].header
    assert second.guards == [
        "tests/conftest.py::test_a",
        "tests/conftest.py::c",
    ]
    assert second.builds_on == [url]
    assert not second.is_upstream and load_series(ws.repo).patches[0].header.is_upstream


def test_builds_on_names_an_earlier_upstream_patch(ws: Workspace) -> None:
    url = "https://github.com/vllm-project/vllm/pull/1"
    _with_header(ws, **{"Builds-On": url})
    _with_header(ws, "0002-b.patch", Origin=f"upstream, {url}", Forwarded=url)
    assert _problems(ws) == [
        f"0001-a.patch: Builds-On {url} is not the upstream URL of an earlier "
        "patch in the series or of a dropped one"
    ]


def _dropped(ws: Workspace, name: str, text: str) -> None:
    folder = ws.repo / "patches" / "dropped"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)


def test_builds_on_a_dropped_patch(ws: Workspace) -> None:
    """A patch upstream has left the series; its record still names the
    change an extension builds on."""
    url = "https://github.com/vllm-project/vllm/pull/1"
    _with_header(ws, **{"Builds-On": url})
    landed = {"Origin": f"upstream, {url}", "Forwarded": url}
    _dropped(ws, "0001-x.dep3", header("x", **landed, **{"Applied-Upstream": "0.34.0"}))
    assert _problems(ws) == []


def test_dropped_records_are_checked(ws: Workspace) -> None:
    _with_header(ws)
    _dropped(ws, "0001-x.dep3", header("x"))
    _dropped(ws, "0002-y.dep3", header("y", Forwarded="later", **{"X-A": "1"}))
    _dropped(ws, "notes.txt", "anything\n")
    assert _problems(ws) == [
        "dropped/0001-x.dep3: Applied-Upstream is empty (a dropped patch names "
        "the vLLM release that has it)",
        "dropped/0002-y.dep3:10: unknown header field 'X-A' (neither DEP-3 nor "
        "declared in README.md's patch headers)",
        "dropped/0002-y.dep3: Forwarded: 'later' is not a DEP-3 value (no, "
        "not-needed, or the URL the change was sent to)",
        "dropped/notes.txt: not a .dep3 record of a dropped patch",
    ]


def test_set_header_field_replaces_the_value_and_its_continuation_lines() -> None:
    head = "Subject: s\nApplied-Upstream: a\n b\nLast-Update: 2026-11-30\n"
    assert set_header_field(head, "applied-upstream", "0.34.0") == (
        "Subject: s\nApplied-Upstream: 0.34.0\nLast-Update: 2026-11-30\n"
    )
    assert set_header_field("Applied-Upstream:\n", "Applied-Upstream", "x") == (
        "Applied-Upstream: x\n"
    )
    with pytest.raises(SeriesError, match="the header has no Bug field"):
        set_header_field(head, "Bug", "x")


def test_a_test_proves_one_patch(ws: Workspace) -> None:
    _with_header(ws, Tests="tests/conftest.py::test_x")
    _with_header(ws, "0002-b.patch", Tests="tests/conftest.py::test_x")
    assert _problems(ws) == [
        "0002-b.patch: Tests names tests/conftest.py::test_x, which "
        "0001-a.patch already names (a test proves one patch)"
    ]


def test_a_test_is_not_its_own_guard(ws: Workspace) -> None:
    _with_header(ws, Guards="tests/conftest.py::test_0001")
    assert _problems(ws) == [
        "0001-a.patch: tests/conftest.py::test_0001 is both in Tests and in Guards"
    ]


def test_guards_must_exist(ws: Workspace) -> None:
    _with_header(ws, Guards="tests/nowhere.py::test_x")
    assert _problems(ws) == [
        "0001-a.patch: Guards names tests/nowhere.py::test_x, but tests/nowhere.py "
        "is missing"
    ]


def test_cli_rejects_each_problem_on_one_line(ws: Workspace, capsys) -> None:
    _with_header(ws, Forwarded="not yet", Tests="tests/conftest.py::a")
    _with_header(ws, "0002-b.patch", Origin="upstream", Tests="tests/b")
    _with_header(ws, "0003-c.patch", **{"Remove-When": None})
    code = main(["--repo", str(ws.repo), "series", "check"])
    out = capsys.readouterr().out.splitlines()
    assert code == 2
    assert out == [
        "error: 0001-a.patch: Forwarded: 'not yet' is not a DEP-3 value (no, "
        "not-needed, or the URL the change was sent to)",
        "error: 0002-b.patch: Origin: an upstream origin carries the URL of the "
        "upstream change ('upstream, https://...'), got 'upstream'",
        "error: 0003-c.patch: header lacks Remove-When",
        "series check: 3 problems",
    ]


def test_tests_must_exist(ws: Workspace) -> None:
    ws.patch_from_edit("0001-a.patch", CONNECTOR, _edit("a"))
    path = ws.repo / "patches" / "0001-a.patch"
    path.write_text(
        path.read_text().replace(
            "Tests: tests/conftest.py", "Tests: tests/nowhere.py::test_x"
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
    assert patch.header.tests == ["tests/conftest.py"]
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


def test_empty_series_is_refused_unless_allowed(ws: Workspace, capsys) -> None:
    """A series file listing no patch (issue 41): applying it is the pinned
    base, so `series check` wants it said with --allow-empty."""
    series_file = ws.repo / "patches" / "series"
    assert _problems(ws) == [
        f"{series_file} lists no patch (applying it is the pinned base; "
        "`series check --allow-empty` accepts that)"
    ]
    assert main(["--repo", str(ws.repo), "series", "check"]) == 2
    assert "lists no patch" in capsys.readouterr().out
    assert main(["--repo", str(ws.repo), "series", "check", "--allow-empty"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("series check: ok, 0 patches")


def test_an_empty_field_is_an_error_not_an_optional_one(ws: Workspace) -> None:
    """DEP-3 leaves an optional field out; an empty one says nothing."""
    _with_header(ws, **{"Applied-Upstream": "", "Bug": ""})
    assert _problems(ws) == [
        "0001-a.patch: Applied-Upstream is empty (DEP-3 leaves an optional field "
        "out instead)",
        "0001-a.patch: Bug is empty (DEP-3 leaves an optional field out instead)",
    ]


def test_description_or_subject_exactly_one(ws: Workspace) -> None:
    """DEP-3's description field is Description or Subject: one, not both."""
    _with_header(ws, Subject="[Bugfix] a title")
    assert _problems(ws) == [
        "0001-a.patch: Description and Subject: DEP-3 takes one of them, not both"
    ]
    _with_header(ws, "0002-b.patch", Description=None)
    _with_header(ws, "0003-c.patch", Description="[Bugfix] only a title")
    assert _problems(ws)[1:] == [
        "0002-b.patch: header lacks Description (or Subject)",
        "0003-c.patch: Description holds only its first line (the PR title); "
        "its continuation lines are the long description",
    ]


def test_a_subject_alone_is_the_title(ws: Workspace) -> None:
    """DEP-3 expects a Subject's long description outside the fields."""
    _with_header(ws, Description=None, Subject="[Bugfix] The title")
    assert _problems(ws) == []
    header = load_series(ws.repo).patches[0].header
    assert (header.subject, header.description) == ("[Bugfix] The title", "")


def test_the_title_is_the_first_line_of_description(ws: Workspace) -> None:
    _with_header(ws, Description="[Bugfix] The title\n The summary.\n Root cause.")
    header = load_series(ws.repo).patches[0].header
    assert header.subject == "[Bugfix] The title"
    assert header.description == "The summary.\nRoot cause."


def test_this_projects_author_carries_the_authors_address(ws: Workspace) -> None:
    ours = "vllm-moriio-overlay <overlay@example.org>"
    _with_header(ws, Author="vllm-moriio-overlay")
    _with_header(ws, "0002-b.patch", Author=ours)
    assert _problems(ws) == [
        "0001-a.patch: Author: vllm-moriio-overlay without an address; write "
        "'vllm-moriio-overlay <email>' as patches/AUTHORS says",
        "patches/AUTHORS is missing: 0002-b.patch is this project's "
        "(vllm-moriio-overlay), whose address it holds",
    ]
    (ws.repo / "patches" / "AUTHORS").write_text(
        "# the address\nvllm-moriio-overlay <other@example.org>\n"
    )
    assert _problems(ws)[1:] == [
        "0002-b.patch: Author: 'vllm-moriio-overlay <overlay@example.org>' is not "
        "patches/AUTHORS's 'vllm-moriio-overlay <other@example.org>'"
    ]
    (ws.repo / "patches" / "AUTHORS").write_text(ours + "\n")
    first = ws.repo / "patches" / "0001-a.patch"
    first.write_text(
        first.read_text().replace("Author: vllm-moriio-overlay\n", f"Author: {ours}\n")
    )
    assert _problems(ws) == []


def test_the_real_series_headers_follow_dep3() -> None:
    """This checkout's series: no Subject, no empty field, our address."""
    from tests.repo import REPO

    assert check_series(REPO, load_pin(REPO / "pin.toml")) == []
    for patch in load_series(REPO).patches:
        head = patch.text.split("\n---\n", 1)[0]
        assert not head.startswith("Subject:") and "\nSubject:" not in head
        assert "Applied-Upstream:\n" not in head + "\n"
