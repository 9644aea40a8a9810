"""`vllm-overlay rebase` onto bases that already hold some of the series.

The newer bases are made here from the pinned base and this repository's own
series: patch 0001 merged whole, only some of its hunks merged, merged in a
form that differs from ours (the realistic case), and the whole series
applied (an overlaid install). A patch whose change adds nothing that is
evidence (lines that existed already, punctuation, blank lines) is never
called upstream on its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.upstream.repos import (
    CLAMP,
    CLAMP_NEW,
    CONNECTOR,
    NEWER,
    REPO,
    MakeRepo,
    diff,
    edit,
    inserted_above,
    newer_wheel,
    patch_text,
    rebase_argv,
    write_tree,
)
from vllm_overlay.cli import main
from vllm_overlay.series.diff import FilePatch, apply_file_patch
from vllm_overlay.series.patch_series import (
    Series,
    check_series,
    load_series,
    put_header_field,
    split_header,
)
from vllm_overlay.series.pin import PIN_FILE, Pin, load_pin
from vllm_overlay.tree.apply import overlay_texts
from vllm_overlay.tree.manifest import (
    MANIFEST_NAME,
    AppliedPatch,
    Manifest,
    encode_manifest,
)


@pytest.fixture(scope="module")
def series() -> Series:
    return load_series(REPO)


@pytest.fixture
def root(make_repo: MakeRepo, series: Series) -> Path:
    """A throwaway checkout holding this repository's series."""
    return make_repo({p.name: p.text for p in series.patches})


def _rebase(
    root: Path, tmp_path: Path, base: dict[str, str], to: Path, *more: str
) -> tuple[int, dict[str, Any]]:
    rc = main([*rebase_argv(root, to, tmp_path, base, report=True), *more])
    return rc, json.loads((tmp_path / "r.json").read_text())


def _rebase_to_patched(
    tmp_path: Path, make_repo: MakeRepo, base: dict[str, str], patched: str
) -> tuple[int, dict[str, Any]]:
    """One patch taking the connector from ``base`` to ``patched``, rebased
    onto a newer tree that already holds ``patched``."""
    change = diff(CONNECTOR, base[CONNECTOR], patched)
    root = make_repo({"0001-x.patch": patch_text("x", [change])})
    return _rebase(root, tmp_path, base, _newer_tree(tmp_path, base, patched))


def _wheel(tmp_path: Path, base: dict[str, str], connector: str) -> Path:
    files = {**base, CONNECTOR: connector}
    return newer_wheel(tmp_path, files)


def _newer_tree(tmp_path: Path, base: dict[str, str], connector: str) -> Path:
    """A tree holding ``connector`` below lines upstream added at the top
    (so that it is not the pinned base with the series applied)."""
    return write_tree(tmp_path / "new", {**base, CONNECTOR: inserted_above(connector)})


def _manifest(series: Series, pin: Pin) -> bytes:
    """What `vllm-overlay apply` leaves next to the module it overlaid
    (its file hashes are not read here)."""
    return encode_manifest(
        Manifest(
            tool_version="0.1.0",
            series_id=series.series_id,
            vllm_version=pin.vllm.version,
            vllm_git_commit=pin.vllm.git_commit,
            patches=[AppliedPatch(p.name, p.text) for p in series.patches],
            files={},
        )
    )


def _results(report: dict[str, Any]) -> list[str]:
    return [r["result"] for r in report["rows"]]


def _moved(series: Series) -> list[str]:
    """What each patch above 0001 gives on a base whose connector holds
    lines inserted above: offset where it changes the connector, clean
    where it changes other MoRIIO files only."""
    return [
        "offset" if any(fp.new_path == CONNECTOR for fp in p.files) else "clean"
        for p in series.patches[1:]
    ]


def _overlaid(base: dict[str, str], series: Series) -> str:
    return overlay_texts(base, series)[CONNECTOR]


def _apply_all(text: str, series: Series) -> str:
    """The series' changes to the connector applied exactly (no offset) to
    ``text`` (a patch may touch other MoRIIO files too)."""
    for patch in series.patches:
        for fp in patch.files:
            if fp.new_path == CONNECTOR:
                text = apply_file_patch(text, fp).text
    return text


def test_a_base_holding_0001_drops_it_records_it_and_rebases_the_rest(
    tmp_path: Path,
    root: Path,
    base_texts: dict[str, str],
    series: Series,
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = series.patches[0]
    (fp,) = first.files
    merged = apply_file_patch(base_texts[CONNECTOR], fp).text
    new = inserted_above(merged)
    rc, report = _rebase(
        root, tmp_path, base_texts, _wheel(tmp_path, base_texts, new), "--write"
    )
    assert rc == 0
    assert _results(report) == ["upstream", *_moved(series)]
    row = report["rows"][0]
    assert row["detail"] == (
        f"moriio_connector.py: every hunk landed ({len(fp.hunks)}); "
        "proposed for removal"
    )
    # Every hunk is named with the place the new base holds it.
    assert [h["hunk"] for h in row["hunks"]] == list(range(1, len(fp.hunks) + 1))
    assert all(
        h["landed"].startswith("its post-image is at lines ") for h in row["hunks"]
    )
    out = capsys.readouterr().out
    assert "moriio_connector.py: hunk #1 landed: its post-image is at lines" in out
    moved = _moved(series)
    clean, offset = moved.count("clean"), moved.count("offset")
    counts = (f"{clean} clean, " if clean else "") + f"{offset} offset, 1 upstream"
    assert out.splitlines()[-1] == (f"rebase: {counts}: the series is on vLLM {NEWER}")
    # 0001 left the series; its header is kept, with the release that has it.
    assert not (root / "patches" / first.name).exists()
    assert load_series(root).names == series.names[1:]
    record = root / "patches" / "dropped" / f"{first.slug}.dep3"
    head, _ = split_header(first.text, first.name)
    assert record.read_text() == put_header_field(head, "Applied-Upstream", NEWER)
    assert f"\nApplied-Upstream: {NEWER}\n" in record.read_text()
    # The rest applies exactly to the new base and gives what the series
    # gave on the pinned one, below the lines upstream added.
    assert _apply_all(new, load_series(root)) == inserted_above(
        _overlaid(base_texts, series)
    )
    # 0009, 0010 and 0013 build on #60867: the record still names it.
    assert check_series(root, load_pin(root / PIN_FILE), tests=False) == []


def test_a_base_holding_some_hunks_of_0001_carries_the_remainder(
    tmp_path: Path,
    root: Path,
    base_texts: dict[str, str],
    series: Series,
    pin: Pin,
) -> None:
    first = series.patches[0]
    (fp,) = first.files
    landed = list(range(0, len(fp.hunks), 2))
    rest = [k for k in range(len(fp.hunks)) if k not in landed]
    part = FilePatch(fp.old_path, fp.new_path, tuple(fp.hunks[k] for k in landed))
    new = inserted_above(apply_file_patch(base_texts[CONNECTOR], part).text)
    rc, report = _rebase(
        root, tmp_path, base_texts, _wheel(tmp_path, base_texts, new), "--write"
    )
    assert rc == 0
    assert _results(report) == ["partly upstream", *_moved(series)]
    row = report["rows"][0]
    numbers = " ".join(f"#{k + 1}" for k in landed)
    carried = " ".join(f"#{k + 1}" for k in rest)
    assert row["detail"] == (
        f"moriio_connector.py: hunk(s) {numbers} landed; {carried} carried "
        "(the remainder)"
    )
    assert [h["hunk"] - 1 for h in row["hunks"] if h["landed"]] == landed
    # 0001 is now its remainder: the hunks that had not landed, as they were.
    after = load_series(root)
    assert after.names == series.names
    refreshed = after.patches[0]
    assert f"Applied-Upstream: {NEWER} (in part)\n" in refreshed.text
    (rfp,) = refreshed.files
    assert [h.lines for h in rfp.hunks] == [fp.hunks[k].lines for k in rest]
    assert not (root / "patches" / "dropped").exists()
    assert _apply_all(new, after) == inserted_above(_overlaid(base_texts, series))
    assert load_pin(root / PIN_FILE).vllm.version == NEWER != pin.vllm.version
    assert check_series(root, load_pin(root / PIN_FILE), tests=False) == []


def _one_line_hunk(fp: FilePatch, text: str) -> int:
    """The first hunk that removes lines and adds exactly one line found
    once in ``text`` (the patched connector)."""
    for k, hunk in enumerate(fp.hunks):
        added = [t for tag, t in hunk.lines if tag == "+"]
        removed = [t for tag, t in hunk.lines if tag == "-"]
        if len(added) == 1 and removed and text.count(added[0]) == 1:
            return k
    raise AssertionError("0001 has no such hunk")


def test_0001_merged_in_another_form_is_partly_upstream_and_names_the_rest(
    tmp_path: Path,
    root: Path,
    base_texts: dict[str, str],
    series: Series,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Upstream merged 0001, but wrote one of its lines its own way: that
    hunk neither applies nor landed (the lines it removes are gone, nothing
    of ours there), every other hunk landed. 0001 landed in another form:
    partly upstream, to refresh by hand; the patches above are assessed with
    it set aside; nothing is dropped or written."""
    (fp,) = series.patches[0].files
    merged = apply_file_patch(base_texts[CONNECTOR], fp).text
    k = _one_line_hunk(fp, merged)
    ours = next(t for tag, t in fp.hunks[k].lines if tag == "+")
    theirs = ours.rstrip("\n") + "  # upstream's own form\n"
    new = edit(merged, ours, theirs)
    rc, report = _rebase(
        root, tmp_path, base_texts, _wheel(tmp_path, base_texts, new), "--write"
    )
    assert rc == 1
    rest = len(series.patches) - 1
    assert _results(report) == ["partly upstream"] + ["clean"] * rest
    row = report["rows"][0]
    others = " ".join(f"#{j + 1}" for j in range(len(fp.hunks)) if j != k)
    assert row["detail"] == (
        "landed in another form as upstream #60867 "
        "(https://github.com/vllm-project/vllm/pull/60867): moriio_connector.py: "
        f"{others} landed; #{k + 1} conflicting"
    )
    assert row["hand"].startswith(f"{series.patches[0].name} cannot be refreshed")
    # Set aside where the patch changes a file 0001 changes (the connector).
    assert all(
        r["set_aside"] == ([series.patches[0].name] if moved == "offset" else [])
        for r, moved in zip(report["rows"][1:], _moved(series), strict=True)
    )
    (failed,) = [h for h in row["hunks"] if h["problem"]]
    assert failed["hunk"] == k + 1 and failed["state"] == "conflicting"
    assert "changed upstream: the" in failed["problem"]
    assert failed["problem"].endswith("0 of its 1 new line(s) there")
    out = capsys.readouterr().out
    assert (
        f"moriio_connector.py: hunk #{k + 1} conflicting: nothing of ours there: "
        "changed upstream: the" in out
    )
    assert out.splitlines()[-1] == (
        f"rebase: {rest} clean, 1 partly upstream: 0001 landed upstream in "
        "another form and needs a hand-refreshed remainder (--refreshed); "
        "nothing in the repository changed"
    )
    assert load_series(root).names == series.names
    assert not (root / "patches" / "dropped").exists()


@pytest.mark.parametrize(
    "added",
    [
        pytest.param("blank", id="a blank line"),
        pytest.param("paren", id="a closing parenthesis"),
        pytest.param("existing", id="a line the file already has"),
    ],
)
def test_a_hunk_without_evidence_is_never_upstream_by_itself(
    tmp_path: Path,
    make_repo: MakeRepo,
    base_texts: dict[str, str],
    added: str,
) -> None:
    """The new base holds the patch's post-image verbatim, but the patch
    adds nothing that shows upstream made this change."""
    base = base_texts[CONNECTOR]
    existing = next(
        line
        for line in base.splitlines(keepends=True)
        if line.strip().startswith("return ") and base.count(line) > 1
    )
    line = {"blank": "\n", "paren": "        )\n", "existing": existing}[added]
    patched = edit(base, CLAMP, CLAMP + line)
    rc, report = _rebase_to_patched(tmp_path, make_repo, base_texts, patched)
    assert rc == 1
    assert _results(report) == ["conflict"]
    (note,) = report["rows"][0]["hunks"]
    assert note["landed"] == ""
    assert "it adds or removes no line that is evidence" in note["problem"]


def test_a_hunk_without_evidence_follows_its_patch(
    tmp_path: Path, make_repo: MakeRepo, base_texts: dict[str, str]
) -> None:
    """A blank line added next to a change that landed on its own evidence:
    its post-image is there verbatim, so it landed with the patch."""
    base = base_texts[CONNECTOR]
    # A class statement of the installed base, read at run time.
    anchor = next(
        line for line in base.splitlines(keepends=True) if line.startswith("class ")
    )
    patched = edit(edit(base, CLAMP, CLAMP_NEW), anchor, "\n" + anchor)
    rc, report = _rebase_to_patched(tmp_path, make_repo, base_texts, patched)
    assert rc == 0
    assert _results(report) == ["upstream"]
    notes = report["rows"][0]["hunks"]
    assert len(notes) == 2 and all(n["landed"] for n in notes)
    assert sum("it follows its patch" in n["landed"] for n in notes) == 1


def test_a_tree_carrying_the_series_is_said_and_left_alone(
    tmp_path: Path,
    root: Path,
    base_texts: dict[str, str],
    series: Series,
    pin: Pin,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`rebase --to` an overlaid install: one line, exit 0, nothing written."""
    files = {**base_texts, **overlay_texts(base_texts, series)}
    tree = write_tree(tmp_path / "site", files)
    (tree / pin.module / MANIFEST_NAME).write_bytes(_manifest(series, pin))
    rc, report = _rebase(root, tmp_path, base_texts, tree, "--write")
    assert rc == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line == (
        f"rebase: {tree}/vllm (source tree) already carries this series (vLLM "
        f"{pin.vllm.version} + {len(series.patches)} patches, series "
        f"{series.series_id}): nothing to do"
    )
    assert report["carries_series"] is True and report["rows"] == []
    assert load_pin(root / PIN_FILE) == pin
    assert load_series(root).names == series.names


def test_a_tree_carrying_another_overlay_is_refused(
    tmp_path: Path,
    root: Path,
    base_texts: dict[str, str],
    series: Series,
    pin: Pin,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An install overlaid by an earlier series (here its first three
    patches) is no upstream base: its patches would look landed."""
    earlier = series.upto(3)
    files = {**base_texts, CONNECTOR: _overlaid(base_texts, earlier)}
    tree = write_tree(tmp_path / "site", files)
    (tree / pin.module / MANIFEST_NAME).write_bytes(_manifest(earlier, pin))
    argv = rebase_argv(root, tree, tmp_path, base_texts)
    assert main([*argv, "--write"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"error: {tree}/vllm (source tree) carries an overlay of "
        f"series {earlier.series_id} (3 patches on vLLM {pin.vllm.version}), not "
        f"this series ({series.series_id}): rebase onto a vLLM without an "
        "overlay (its wheel, or the tree after `vllm-overlay apply --revert`)\n"
    )
    assert load_pin(root / PIN_FILE) == pin
    assert load_series(root).names == series.names
