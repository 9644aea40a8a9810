"""What counts as evidence that a hunk landed, on small texts of our own."""

from __future__ import annotations

import pytest

from vllm_overlay.series.diff import parse_patch, unified_diff
from vllm_overlay.upstream.rebase.landed import (
    SLACK,
    check_hunks,
    is_trivial,
    names_in,
)

# A made-up module: 40 numbered filler lines around one small function.
FILLER = [f"value_{i} = compute({i})\n" for i in range(40)]
FUNC = [
    "def pick(groups):\n",
    "    first = groups[0]\n",
    "    return first\n",
]
OLD = "".join(FILLER[:20] + FUNC + FILLER[20:])
# Our change: pick every group.
OURS = OLD.replace(
    "    first = groups[0]\n    return first\n",
    "    picked = [g for g in groups]\n    return picked\n",
)


def _checks(new: str, old: str = OLD, ours: str = OURS):
    (fp,) = parse_patch(unified_diff("m.py", old, ours))
    return check_hunks(old, new, fp)


@pytest.mark.parametrize(
    ("line", "trivial"),
    [
        ("\n", True),
        ("    )\n", True),
        ("        ],\n", True),
        ('    """\n', True),
        ("    else:\n", True),
        ("        return None\n", True),
        ("    return picked\n", False),
        ("    # why this is so\n", False),
        ("    strict=True,\n", False),
    ],
)
def test_trivial_lines(line: str, trivial: bool) -> None:
    assert is_trivial(line) is trivial


def test_verbatim_post_image_landed() -> None:
    new = "# a line upstream added\n" + OURS
    (c,) = _checks(new)
    assert c.landed and c.exact
    assert c.added == ["    picked = [g for g in groups]", "    return picked"]
    assert c.removed == ["    first = groups[0]", "    return first"]
    # Lines of the new base: the filler, the def, then the two new lines.
    assert c.evidence() == ["23: picked = [g for g in groups]", "24: return picked"]


def test_same_lines_with_other_context_landed_near() -> None:
    new = OURS.replace("def pick(groups):\n", "def pick(groups, *, strict):\n")
    (c,) = _checks(new)
    assert c.post_at is None and c.landed and c.near
    assert [n for n, _ in c.found] == [22, 23]
    assert "context differs" in c.landed_summary()


def test_a_line_left_that_it_removes_is_not_landed() -> None:
    # Upstream added our lines but kept the old assignment too.
    new = OURS.replace(
        "    picked = [g for g in groups]\n",
        "    first = groups[0]\n    picked = [g for g in groups]\n",
    )
    (c,) = _checks(new)
    assert not c.landed and not c.changed_upstream
    assert c.still == [(22, "    first = groups[0]")]


def test_written_another_way_is_changed_upstream() -> None:
    new = OLD.replace(
        "    first = groups[0]\n    return first\n",
        "    return list(groups)\n",
    )
    (c,) = _checks(new)
    assert not c.landed and c.changed_upstream
    assert c.problem() == (
        "context not found; changed upstream: the 2 line(s) it removes are gone; "
        "0 of its 2 new line(s) there"
    )


def test_new_lines_far_from_the_hunk_do_not_count() -> None:
    far = "".join(FILLER[:20] + FUNC + FILLER[20:] + ["\n"] * (2 * SLACK))
    far += "def other(groups):\n    picked = [g for g in groups]\n    return picked\n"
    # ... and the function the hunk changes was edited upstream.
    new = far.replace("    first = groups[0]\n", "    first = groups[-1]\n")
    (c,) = _checks(new)
    assert not c.landed and c.found == []


def test_added_lines_the_old_text_had_are_no_evidence() -> None:
    """``return first`` stands elsewhere in the old text: adding it proves
    nothing, so a hunk that only adds it has no evidence."""
    old = OLD + "def last(groups):\n    first = groups[-1]\n    return first\n"
    ours = old.replace("    return first\n", "    return first\n    return first\n", 1)
    (c,) = _checks(ours, old=old, ours=ours)
    assert c.added == [] and c.removed == []
    assert not c.has_evidence and not c.landed and c.post_at is not None


def test_a_moved_line_is_neither_added_nor_removed() -> None:
    ours = OLD.replace(
        "    first = groups[0]\n    return first\n",
        "    return first\n    first = groups[0]\n",
    )
    (c,) = _checks(ours, ours=ours)
    assert c.removed == [] and c.added == []


def test_an_insertion_is_looked_for_where_its_insertion_point_went() -> None:
    """A hunk without context that only inserts: its region is around the
    line it inserts after, wherever that line went in the new base."""
    ours = OLD.replace(FILLER[30], FILLER[30] + "extra = special()\n")
    (fp,) = parse_patch(unified_diff("m.py", OLD, ours, context=0))
    assert fp.hunks[0].old_len == 0
    # Upstream added lines at the top and changed a line far above ours.
    new = "".join(f"# top {i}\n" for i in range(5)) + OLD.replace(
        FILLER[2], "value_2 = other()\n"
    )
    (c,) = check_hunks(OLD, new, fp)
    # FILLER[30] is old line 34 (after the function's three lines); it is
    # line 39 of the new base, and the hunk inserts right after it. The
    # region ends with the file (48 lines).
    assert c.region == (39 - SLACK + 1, min(48, 39 + SLACK))
    assert not c.landed and c.found == []
    (c,) = check_hunks(
        OLD, new.replace(FILLER[30], FILLER[30] + "extra = special()\n"), fp
    )
    assert c.landed and c.exact and c.evidence() == ["40: extra = special()"]


def test_names_are_identifiers_in_code_not_words() -> None:
    lines = [
        "    spec = KVCacheSpec(block_size)  # Sliding window_size here\n",
        '    i_j = get_kv_cache_spec_sliding_window(spec, "a_string")\n',
        "    Sliding = ring\n",
    ]
    assert names_in(lines) == [
        "KVCacheSpec",
        "block_size",
        "get_kv_cache_spec_sliding_window",
        "a_string",
    ]


def test_a_hunk_upstream_rewrote_with_a_new_name_of_ours_is_in_another_form() -> None:
    """The line it removes is gone; none of its lines is there, but the new
    name it adds is (elsewhere in the file): changed in another form."""
    ours = OLD.replace("    first = groups[0]\n", "    first = pick_first(groups)\n")
    theirs = OLD.replace("    first = groups[0]\n", "    first = groups.head()\n")
    theirs += "def pick_first(groups):\n    return groups[0]\n"
    (check,) = _checks(theirs, ours=ours)
    assert check.changed_upstream and check.in_another_form
    assert check.names == check.names_found == ["pick_first"]
    assert check.problem().endswith("its new name(s) there: pick_first")
    # Without our name there: changed upstream, nothing of ours.
    bare = OLD.replace("    first = groups[0]\n", "    first = groups.head()\n")
    (check,) = _checks(bare, ours=ours)
    assert check.changed_upstream and not check.in_another_form
