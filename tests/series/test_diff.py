"""The exact applier: no fuzz, offsets only when asked, and reversible."""

from __future__ import annotations

import pytest

from tests.workspace import make_diff
from vllm_overlay.series.diff import DiffError, HunkError, apply_file_patch, parse_patch

OLD = "".join(f"line {i}\n" for i in range(1, 41))
NEW = OLD.replace("line 10\n", "line ten\n").replace("line 30\n", "")


def _patch():
    (fp,) = parse_patch(make_diff("f.py", OLD, NEW))
    return fp


def test_apply_and_reverse_round_trip() -> None:
    fp = _patch()
    assert len(fp.hunks) == 2
    result = apply_file_patch(OLD, fp)
    assert result.text == NEW
    assert result.max_offset == 0
    assert apply_file_patch(NEW, fp.reversed()).text == OLD


def test_offset_is_refused_unless_asked() -> None:
    fp = _patch()
    shifted = "extra\nextra\n" + OLD
    with pytest.raises(HunkError, match="offset \\+2"):
        apply_file_patch(shifted, fp)
    result = apply_file_patch(shifted, fp, offset=True)
    assert result.text == "extra\nextra\n" + NEW
    assert [h.offset for h in result.hunks] == [2, 2]


def test_changed_context_is_never_fuzzed() -> None:
    fp = _patch()
    drifted = OLD.replace("line 8\n", "line eight\n")
    with pytest.raises(HunkError, match="hunk #1"):
        apply_file_patch(drifted, fp, offset=True)


def test_malformed_diffs() -> None:
    with pytest.raises(DiffError, match="no file diffs"):
        parse_patch("hello\n")
    with pytest.raises(DiffError, match="truncated"):
        parse_patch("--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n x\n")
    with pytest.raises(DiffError, match="creating or deleting"):
        parse_patch("--- /dev/null\n+++ b/f\n@@ -0,0 +1 @@\n+x\n")
