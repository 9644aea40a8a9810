"""The PR body's sections come from the header's Description paragraphs."""

from __future__ import annotations

import pytest

from vllm_overlay.series.patch_series import parse_header
from vllm_overlay.upstream.prbody import BodyError, split_description, unwrap

HEAD = """Description: [ROCm][P/D] MoRIIO: read only missing pages
 with a decoder prefix hit, read only the pages it lacks.
 Root cause: the decoder reports E external tokens, but the tables
 hold every page.
 .
 What changes: both legs are sliced to the same page
 indices.
 - first item
   continued
 - second item
 .
 Contract change: a short table raises MoRIIOError.
Origin: upstream, https://github.com/vllm-project/vllm/pull/1
Author: someone
Forwarded: no
Last-Update: 2026-11-30
Remove-When: never
Tests: tests/patches/test_x.py::test_x
"""


def test_sections_and_labels() -> None:
    header = parse_header(HEAD, "x.patch")
    s = split_description(header)
    assert s.purpose == "With a decoder prefix hit, read only the pages it lacks."
    assert s.root_cause == [
        "The decoder reports E external tokens, but the tables\nhold every page."
    ]
    assert len(s.changes) == 2
    assert unwrap(s.changes[0]) == (
        "What changes: both legs are sliced to the same page indices.\n"
        "- first item continued\n- second item"
    )
    from vllm_overlay.upstream.prbody import label_changes

    assert label_changes(unwrap(s.changes[0])).startswith("Both legs are sliced")
    assert label_changes(s.changes[1]) == (
        "**Contract change:** a short table raises MoRIIOError."
    )


def test_parenthesised_label_and_links() -> None:
    from vllm_overlay.upstream.prbody import _links, label_changes

    assert label_changes("What changes (one file only): x") == (
        "**What changes (one file only):** x"
    )
    header = parse_header(
        HEAD.replace(
            "Forwarded: no",
            "Forwarded: https://github.com/vllm-project/vllm/pull/1",
        ).replace("pull/1\nAuthor", "pull/1);\nAuthor"),
        "x.patch",
    )
    assert _links(header) == [
        "- Origin, Forwarded: https://github.com/vllm-project/vllm/pull/1"
    ]


def test_first_paragraph_is_the_root_cause_without_a_label() -> None:
    text = HEAD.replace("Root cause: the decoder", "The decoder")
    s = split_description(parse_header(text, "x.patch"))
    assert s.root_cause[0].startswith("The decoder reports")


def test_summary_only_is_refused() -> None:
    lines = HEAD.splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Description"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("Origin"))
    text = "".join(lines[: start + 2] + lines[end:])  # the title and a summary
    with pytest.raises(BodyError, match="only its summary line"):
        split_description(parse_header(text, "x.patch"))
