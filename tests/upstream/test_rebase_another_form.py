"""`vllm-overlay rebase` of a patch that landed upstream in another form.

vLLM-free: the pinned base is a small synthetic connector (its own pin),
patch 0001 changes five places of it (hunks A to E), and the newer bases
are that connector as upstream might have changed it. 0002 and 0003 are
made on top of 0001: 0002 far from it, 0003 on a line 0001 adds in C.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.upstream.repos import (
    CONNECTOR,
    NEWER,
    SPDX,
    MakeRepo,
    diff,
    edit,
    newer_wheel,
    patch_text,
    rebase_argv,
    write_wheel,
)
from vllm_overlay.cli import main
from vllm_overlay.series.diff import apply_file_patch
from vllm_overlay.series.patch_series import (
    load_series,
    put_header_field,
    set_header_field,
)
from vllm_overlay.series.pin import PIN_FILE, Pin, VllmBase, load_pin, sha256_bytes

PR = "https://github.com/vllm-project/vllm/pull/12345"


def _filler(tag: str) -> str:
    return "".join(f"FILLER_{tag}_{i} = {i}\n" for i in range(8))


# The five places 0001 changes, as the pinned base has them and as 0001
# leaves them.
OLD_PARTS = {
    "A": "def alpha(x):\n    return x + 1\n",
    "B": "def beta(y):\n    total = y * 2\n    return total\n",
    "C": (
        "def gamma(z):\n    result = z - 1\n    result = result * 3\n"
        "    return result\n"
    ),
    "D": "def delta(w):\n    return w\n",
    "E": "def epsilon(v):\n    keep = v + 10\n    return keep\n",
}
OURS_PARTS = {
    "A": "def alpha(x):\n    return clamp_value(x + 1)\n",
    "B": "def beta(y):\n    total = scaled_total(y)\n    return total\n",
    "C": (
        "def gamma(z):\n    result = adjusted_result(z)\n"
        "    result = bounded_result(result)\n    return result\n"
    ),
    "D": "def delta(w):\n    return w_with_limit(w)\n",
    "E": "def epsilon(v):\n    keep = guarded_keep(v)\n    return keep\n",
}


def _connector(parts: dict[str, str]) -> str:
    text = SPDX + _filler("top")
    for key in "ABCDE":
        text += parts[key] + _filler(key)
    return text


OLD = _connector(OLD_PARTS)
OURS = _connector(OURS_PARTS)
# Upstream merged 0001 its own way: A and B verbatim; C rewritten with one
# of our two lines; D untouched (ours still to carry); E's function got a
# new parameter, so our change there conflicts.
FORM = _connector(
    {
        **OURS_PARTS,
        "C": (
            "def gamma(z):\n    result = adjusted_result(z)\n"
            "    result = upstream_bound(result, 3)\n    return result\n"
        ),
        "D": OLD_PARTS["D"],
        "E": "def epsilon(v, limit):\n    keep = v + 10\n    return keep\n",
    }
)
# 0002: far from every hunk of 0001. 0003: on a line 0001 adds in C.
AFTER_2 = edit(OURS, "FILLER_B_4 = 4\n", "FILLER_B_4 = 40\n")
AFTER_3 = edit(
    AFTER_2,
    "    result = bounded_result(result)\n",
    "    result = bounded_result(result, 2)\n",
)


def _pin(pin: Pin, **vllm: str) -> Pin:
    """The real pin, made for the synthetic base."""
    return msgspec.structs.replace(
        pin,
        vllm=msgspec.structs.replace(pin.vllm, **vllm) if vllm else pin.vllm,
        files={CONNECTOR: sha256_bytes(OLD.encode())},
    )


def _first(origin: bool = True) -> str:
    text = patch_text("upstream change", [diff(CONNECTOR, OLD, OURS)])
    if origin:
        text = set_header_field(text, "Origin", f"upstream, {PR}")
        text = set_header_field(text, "Forwarded", PR)
    return text


def _series() -> dict[str, str]:
    return {
        "0001-upstream-change.patch": _first(),
        "0002-far.patch": patch_text("far", [diff(CONNECTOR, OURS, AFTER_2)]),
        "0003-on-c.patch": patch_text("on c", [diff(CONNECTOR, AFTER_2, AFTER_3)]),
    }


def _rebase(
    root: Path, tmp_path: Path, new: str, *more: str
) -> tuple[int, dict[str, Any]]:
    wheel = newer_wheel(tmp_path, {CONNECTOR: new})
    # A series read from a git ref takes its old base from that ref's pin.
    old = None if "--series-ref" in more else {CONNECTOR: OLD}
    rc = main([*rebase_argv(root, wheel, tmp_path, old, report=True), *more])
    report = tmp_path / "r.json"
    return rc, json.loads(report.read_text()) if report.exists() else {}


def _labels(report: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    return [(r["patch"][:4], r["result"], r["set_aside"]) for r in report["rows"]]


def _alone(*results: str) -> list[tuple[str, str, list[str]]]:
    """The labels of 0001, 0002, ... with ``results``, none of them set aside."""
    return [(f"{i:04d}", result, []) for i, result in enumerate(results, 1)]


def _states(row: dict[str, Any]) -> dict[int, str]:
    return {h["hunk"]: h["state"] for h in row["hunks"] if h["state"]}


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.parts
    }


def test_a_patch_landed_in_another_form_is_partly_upstream_with_evidence(
    tmp_path: Path,
    make_repo: MakeRepo,
    pin: Pin,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = make_repo(_series(), _pin(pin))
    before = _snapshot(root)
    rc, report = _rebase(root, tmp_path, FORM, "--write")
    assert rc == 1
    one = "0001-upstream-change.patch"
    assert _labels(report) == [
        ("0001", "partly upstream", []),
        ("0002", "clean", [one]),
        ("0003", "conflict", [one]),
    ]
    row = report["rows"][0]
    assert row["detail"] == (
        f"landed in another form as upstream #12345 ({PR}): moriio_connector.py: "
        "#1 #2 landed; #3 changed upstream; #4 still to carry; #5 conflicting"
    )
    assert row["landed_as"] == f"#12345 ({PR})"
    assert _states(row) == {
        1: "landed",
        2: "landed",
        3: "changed upstream",
        4: "still to carry",
        5: "conflicting",
    }
    changed = next(h for h in row["hunks"] if h["hunk"] == 3)
    assert changed["problem"] == (
        "context not found; changed upstream: the 2 line(s) it removes are gone; "
        "1 of its 2 new line(s) there; its new name(s) there: adjusted_result"
    )
    assert row["hand"] == (
        f"{one} cannot be refreshed mechanically: refresh its remainder by hand "
        '(docs/upstream.md, "re-basing by hand"), set Applied-Upstream: '
        f"{NEWER} (in part), and run again with --refreshed PATH/{one}"
    )
    # The 3-way merge is written for review, as for a conflict.
    (merged,) = row["merged"]
    assert Path(merged).is_file() and row["conflicts"]
    for suffix in ("new-base", "old-base", "old-patched"):
        assert Path(merged).with_suffix(f".{suffix}").is_file()
    out = capsys.readouterr().out.splitlines()
    assert "      moriio_connector.py: hunk #1 landed: its post-image is at lines" in (
        "\n".join(out)
    )
    assert any(
        line.startswith("      moriio_connector.py: hunk #4 still to carry: applies")
        for line in out
    )
    assert f"      by hand: {row['hand']}" in out
    assert any(
        line.startswith("  0002-far.patch") and "clean (0001 set aside)" in line
        for line in out
    )
    assert out[-1] == (
        "rebase: 1 clean, 1 partly upstream, 1 conflict: not every patch "
        "applies; 0001 landed upstream in another form and needs a "
        "hand-refreshed remainder (--refreshed); nothing in the repository changed"
    )
    # --write refused: the repository is untouched.
    assert _snapshot(root) == before


def _rewritten(c: bool, e: bool, a_landed: bool) -> str:
    """Upstream rewrote C and/or E with nothing of ours in them; A landed
    verbatim or not."""
    parts = dict(OLD_PARTS)
    if c:
        parts["C"] = "def gamma(z):\n    result = (z - 1) * 3\n    return result\n"
    if e:
        parts["E"] = "def epsilon(v):\n    keep = v + 100\n    return keep\n"
    if a_landed:
        parts["A"] = OURS_PARTS["A"]
    return _connector(parts)


@pytest.mark.parametrize(
    ("c", "e", "a_landed"),
    [
        pytest.param(True, True, False, id="nothing landed"),
        pytest.param(True, True, True, id="one hunk landed, two rewritten"),
        pytest.param(True, False, True, id="one landed, one rewritten: a tie"),
    ],
)
def test_a_genuine_conflict_stays_a_conflict(
    tmp_path: Path,
    make_repo: MakeRepo,
    pin: Pin,
    c: bool,
    e: bool,
    a_landed: bool,
) -> None:
    """Upstream rewrote the lines 0001 changes with nothing of ours in
    them: a conflict, each hunk's state said; the patches above are
    blocked, not assessed without it."""
    root = make_repo(_series(), _pin(pin))
    rc, report = _rebase(root, tmp_path, _rewritten(c, e, a_landed))
    assert rc == 1
    assert _labels(report) == _alone("conflict", "blocked", "blocked")
    row = report["rows"][0]
    assert row["hand"] == ""
    expected = {
        1: "landed" if a_landed else "still to carry",
        2: "still to carry",
        3: "conflicting" if c else "still to carry",
        4: "still to carry",
        5: "conflicting" if e else "still to carry",
    }
    assert _states(row) == expected
    assert not row["detail"].startswith("landed in another form")


def _refreshed(tmp_path: Path, applied: str = f"{NEWER} (in part)") -> Path:
    """0001's remainder, refreshed by hand for FORM: D as ours, E on
    upstream's new signature, C back to our bound (0003 edits it)."""
    remainder = _connector(
        {
            **OURS_PARTS,
            "E": (
                "def epsilon(v, limit):\n    keep = guarded_keep(v)\n    return keep\n"
            ),
        }
    )
    text = patch_text("upstream change", [diff(CONNECTOR, FORM, remainder)])
    text = set_header_field(text, "Origin", f"upstream, {PR}")
    text = put_header_field(text, "Applied-Upstream", applied)
    path = tmp_path / "refreshed" / "0001-upstream-change.patch"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_a_hand_refreshed_remainder_is_carried_and_written(
    tmp_path: Path, make_repo: MakeRepo, pin: Pin, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_repo(_series(), _pin(pin))
    given = _refreshed(tmp_path)
    rc, report = _rebase(root, tmp_path, FORM, "--refreshed", str(given), "--write")
    assert rc == 0
    assert _labels(report) == _alone("partly upstream", "clean", "clean")
    row = report["rows"][0]
    assert row["hand"] == "" and row["refreshed"] == str(given)
    assert row["detail"].startswith(
        f"carried as its hand-refreshed remainder {given} (applies); landed in "
        "another form as upstream #12345"
    )
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"rebase: 2 clean, 1 partly upstream: the series is on vLLM {NEWER}"
    )
    # 0001 is the remainder as given; the series applies to the new base.
    assert (root / "patches" / given.name).read_text() == given.read_text()
    text = FORM
    for patch in load_series(root).patches:
        for fp in patch.files:
            text = apply_file_patch(text, fp).text
    assert text == edit(AFTER_3, "def epsilon(v):\n", "def epsilon(v, limit):\n")
    assert load_pin(root / PIN_FILE).vllm.version == NEWER


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        pytest.param(
            "applied",
            "Applied-Upstream is 0.99.0; a hand-refreshed remainder of a patch vLLM "
            "0.99.0 has in part says 'Applied-Upstream: 0.99.0 (in part)'",
            id="Applied-Upstream without (in part)",
        ),
        pytest.param(
            "name",
            "names no patch of the series (the file is named as the patch it "
            "replaces, e.g. 0001-upstream-change.patch)",
            id="a name the series does not have",
        ),
        pytest.param(
            "not landed",
            "0002-far.patch did not land upstream in another form on this base (it "
            "is clean); a hand-refreshed version replaces only such a patch",
            id="a patch that did not land",
        ),
    ],
)
def test_a_bad_refreshed_patch_is_one_line_and_changes_nothing(
    tmp_path: Path,
    make_repo: MakeRepo,
    pin: Pin,
    capsys: pytest.CaptureFixture[str],
    problem: str,
    message: str,
) -> None:
    root = make_repo(_series(), _pin(pin))
    before = _snapshot(root)
    given = _refreshed(
        tmp_path, NEWER if problem == "applied" else f"{NEWER} (in part)"
    )
    if problem == "name":
        given = given.rename(given.with_name("0009-other.patch"))
    if problem == "not landed":
        other = given.with_name("0002-far.patch")
        other.write_text(
            put_header_field(
                _series()["0002-far.patch"], "Applied-Upstream", f"{NEWER} (in part)"
            )
        )
        given = other
    rc, _ = _rebase(root, tmp_path, FORM, "--refreshed", str(given), "--write")
    assert rc == 2
    err = capsys.readouterr().err
    assert err == f"error: --refreshed {given}: {message}\n"
    assert _snapshot(root) == before


def _git(root: Path, *args: str) -> str:
    run = subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return run.stdout.strip()


def test_series_ref_reads_the_series_of_a_ref_from_a_fresh_clone(
    tmp_path: Path,
    make_repo: MakeRepo,
    pin: Pin,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The old series is tagged and on a release branch; main moved on (its
    series lost 0002 and 0003). A fresh clone reads the tagged series, its
    pinned wheel taken from --cache."""
    cache = tmp_path / "cache"
    cache.mkdir()
    old_wheel = write_wheel(
        cache / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        {CONNECTOR: OLD},
        "0.33.0",
    )
    sha = hashlib.sha256(old_wheel.read_bytes()).hexdigest()
    old_pin = _pin(pin, version="0.33.0", wheel=old_wheel.name, wheel_sha256=sha)
    assert isinstance(old_pin.vllm, VllmBase)
    root = make_repo(_series(), old_pin)
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "the old series")
    _git(root, "tag", "series-old")
    _git(root, "branch", "release/old")
    (root / "patches" / "series").write_text("0001-upstream-change.patch\n")
    _git(root, "commit", "-qam", "main moves on")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True)
    more = ["--cache", str(cache), "--series-ref"]
    for ref in ("series-old", "origin/release/old"):
        rc, report = _rebase(clone, tmp_path, FORM, *more, ref)
        assert rc == 1, ref
        assert [r[0] for r in _labels(report)] == ["0001", "0002", "0003"]
        assert report["series_ref"].startswith(f"{ref} (")
        assert report["from_version"] == "0.33.0"
        out = capsys.readouterr().out.splitlines()
        assert out[1].startswith(f"rebase: the series of {ref} (")
    # The branch itself is only origin/... in a fresh clone; --write is refused.
    rc, _ = _rebase(clone, tmp_path, FORM, *more, "release/old")
    assert rc == 2
    assert "no such commit" in capsys.readouterr().err
    rc, _ = _rebase(clone, tmp_path, FORM, *more, "series-old", "--write")
    assert rc == 2
    assert capsys.readouterr().err == (
        "error: --series-ref series-old with --write: the series of a ref is only "
        "assessed here; check that ref out to rebase it\n"
    )
    assert _git(clone, "status", "--porcelain") == ""


def test_a_refreshed_remainder_that_does_not_apply_is_a_conflict(
    tmp_path: Path, make_repo: MakeRepo, pin: Pin
) -> None:
    """A remainder made for the wrong base (here the pinned one): a conflict
    that says so; the patches above are blocked; nothing is written."""
    root = make_repo(_series(), _pin(pin))
    before = _snapshot(root)
    given = tmp_path / "0001-upstream-change.patch"
    text = patch_text("upstream change", [diff(CONNECTOR, OLD, OURS)])
    given.write_text(put_header_field(text, "Applied-Upstream", f"{NEWER} (in part)"))
    rc, report = _rebase(root, tmp_path, FORM, "--refreshed", str(given), "--write")
    assert rc == 1
    assert _labels(report) == _alone("conflict", "blocked", "blocked")
    row = report["rows"][0]
    assert row["refreshed"] == str(given) and row["hand"] == ""
    assert row["detail"].startswith(
        f"its hand-refreshed remainder {given} does not apply to the new base "
        "("
        + "; ".join(
            f"moriio_connector.py hunk #{k}: context not found" for k in (1, 2, 3, 5)
        )
        + "); landed in another form as upstream #12345"
    )
    assert _snapshot(root) == before
