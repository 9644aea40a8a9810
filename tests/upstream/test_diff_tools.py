"""diff.py additions used by export and rebase: exact diffs, header shifts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.upstream.repos import REPO
from vllm_overlay.series.diff import (
    FilePatch,
    apply_file_patch,
    format_file_patch,
    git_blob_sha1,
    parse_patch,
    place_hunks,
    shift_hunk_headers,
    unified_diff,
)
from vllm_overlay.series.patch_series import load_series, split_header

OLD = "".join(f"line {i}\n" for i in range(1, 41))


def test_unified_diff_round_trips_and_is_empty_for_equal_texts() -> None:
    new = OLD.replace("line 10\n", "line ten\n").replace("line 30\n", "")
    text = unified_diff("x/f.py", OLD, new)
    assert text.startswith("diff --git a/x/f.py b/x/f.py\n--- a/x/f.py\n+++ b/x/f.py\n")
    (fp,) = parse_patch(text)
    assert apply_file_patch(OLD, fp).text == new
    assert unified_diff("x/f.py", OLD, OLD) == ""


@pytest.mark.parametrize(
    ("old", "new"),
    [("a\nb\nc", "a\nb\nc\n"), ("a\nb\nc\n", "a\nb\nc"), ("a\nb", "a\nB")],
)
def test_unified_diff_missing_final_newline(old: str, new: str) -> None:
    text = unified_diff("f", old, new)
    assert "\\ No newline at end of file" in text
    (fp,) = parse_patch(text)
    assert apply_file_patch(old, fp).text == new
    assert apply_file_patch(new, fp.reversed()).text == old


lines = st.lists(st.sampled_from(["a\n", "b\n", "c\n", "d\n", "e\n"]), max_size=30)


@settings(max_examples=200, deadline=None)
@given(lines, lines)
def test_unified_diff_is_exact(old: list[str], new: list[str]) -> None:
    a, b = "".join(old), "".join(new)
    text = unified_diff("f", a, b)
    if a == b:
        assert text == ""
        return
    (fp,) = parse_patch(text)
    assert apply_file_patch(a, fp).text == b


def test_shift_hunk_headers_moves_only_the_numbers() -> None:
    new = OLD.replace("line 10\n", "line ten\n").replace("line 30\n", "")
    text = "Subject: x\n---\n" + unified_diff("f", OLD, new)
    shifted_base = "top 1\ntop 2\ntop 3\n" + OLD
    (fp,) = parse_patch(text)
    offsets = [h.offset for h in apply_file_patch(shifted_base, fp, offset=True).hunks]
    assert offsets == [3, 3]
    out = shift_hunk_headers(text, {"f": offsets})
    assert out.startswith("Subject: x\n---\n")
    assert "@@ -10,7 +10,7 @@" in out and "@@ -10,7 +10,7 @@" not in text
    (moved,) = parse_patch(out)
    assert [h.lines for h in moved.hunks] == [h.lines for h in fp.hunks]
    assert apply_file_patch(shifted_base, moved).text == "top 1\ntop 2\ntop 3\n" + new
    assert shift_hunk_headers(text, {}) == text


def test_git_blob_sha1_matches_git(tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(b"hello\nworld\n")
    expected = subprocess.run(
        ["git", "hash-object", str(f)], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert git_blob_sha1(b"hello\nworld\n") == expected


def test_every_patch_of_the_series_is_rendered_back_byte_for_byte() -> None:
    """``format_file_patch`` of a parsed patch, its hunks placed where they
    were, is the patch's diff as it stands in patches/ (after its index
    line)."""
    for patch in load_series(REPO).patches:
        _, body = split_header(patch.text, patch.name)
        for fp in patch.files:
            placed = place_hunks(fp.hunks, [0] * len(fp.hunks))
            assert placed == fp.hunks, patch.name
            text = format_file_patch(FilePatch(fp.old_path, fp.new_path, placed))
            head, hunks = text.split("\n+++ ", 1)[0], text.split("@@", 1)[1]
            assert head.startswith(f"diff --git a/{fp.path} b/{fp.path}\n--- ")
            assert "@@" + hunks in body, patch.name


@settings(max_examples=200, deadline=None)
@given(lines, lines, st.lists(st.booleans(), min_size=8, max_size=8), lines)
def test_a_subset_of_hunks_placed_anew_is_a_patch_of_its_own(
    old: list[str], new: list[str], keep: list[bool], top: list[str]
) -> None:
    """Some hunks of a diff, on a text with lines added at the top: placed
    at the offsets they apply at, they apply exactly and give the same."""
    a, b = "".join(old), "".join(new)
    text = unified_diff("f", a, b, context=1)
    if not text:
        return
    (fp,) = parse_patch(text)
    subset = [h for h, k in zip(fp.hunks, keep, strict=False) if k]
    if not subset:
        return
    sub = FilePatch("f", "f", tuple(subset))
    target = "".join(top) + a
    done = apply_file_patch(target, sub, offset=True)
    placed = place_hunks(subset, [h.offset for h in done.hunks])
    (again,) = parse_patch(format_file_patch(FilePatch("f", "f", placed)))
    assert apply_file_patch(target, again).text == done.text


def test_place_hunks_refuses_a_count_mismatch() -> None:
    (fp,) = parse_patch(unified_diff("f", OLD, OLD.replace("line 10\n", "")))
    with pytest.raises(ValueError, match="1 hunks, 2 offsets"):
        place_hunks(fp.hunks, [0, 0])
