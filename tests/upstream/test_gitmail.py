"""The mails of a series apply with git am in order; one that does not is
named by its place."""

from __future__ import annotations

import pytest

from vllm_overlay.upstream.gitmail import (
    GitMailError,
    Identity,
    am_series,
    format_patch,
)

AUTHOR = Identity("A U Thor", "author@example.com")
DATE = "2026-01-01T00:00:00+00:00"


def _mail(before: str, after: str, subject: str) -> str:
    return format_patch({"f.py": before}, {"f.py": after}, AUTHOR, DATE, subject)


def test_the_mails_apply_in_order() -> None:
    one = _mail("a = 1\n", "a = 2\n", "one")
    two = _mail("a = 2\n", "a = 2\nb = 3\n", "two")
    assert am_series({"f.py": "a = 1\n"}, [one, two], ["f.py"]) == {
        "f.py": "a = 2\nb = 3\n"
    }


@pytest.mark.parametrize("bad", [1, 2, 3])
def test_a_mail_that_does_not_apply_is_named_by_its_place(bad: int) -> None:
    steps = ["a = 1\n", "a = 2\n", "a = 3\n", "a = 4\n"]
    mails = [_mail(steps[i], steps[i + 1], f"step {i + 1}") for i in range(3)]
    mails[bad - 1] = _mail("x = 0\n", "x = 1\n", "elsewhere")
    with pytest.raises(GitMailError, match=f"^mail {bad} of 3: "):
        am_series({"f.py": "a = 1\n"}, mails, ["f.py"])
