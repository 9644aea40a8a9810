"""`vllm-overlay export` on a throwaway series made against the real base.

The series, its tests and its unit-base report are made here: the export
machinery is what is under test (the real series is exported by
`nox -s export` at integration). The report is an input the test writes;
export must use it as given and refuse a missing or foreign one.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.upstream.repos import (
    COMMON,
    CONNECTOR,
    MakeRepo,
    diff,
    edit,
    patch_text,
)
from vllm_overlay.checkout import Checkout
from vllm_overlay.cli import main
from vllm_overlay.gate.reports import (
    RevertRedReport,
    RevertRedRow,
    StackRow,
    encode_report,
    unit_base_report_path,
)
from vllm_overlay.series.patch_series import load_series
from vllm_overlay.series.pin import Pin, load_pin
from vllm_overlay.tree.materialize import BaseSource
from vllm_overlay.upstream.export import ExportError, export, find_ruff, load_context
from vllm_overlay.upstream.gitmail import Identity
from vllm_overlay.upstream.testport import SPDX_HEADER

CONFIG = Path(__file__).resolve().parents[2] / "ci" / "ruff-vllm.toml"
PIN = load_pin(Path(__file__).resolve().parents[2] / "pin.toml")
SPDX = "# SPDX-License-Identifier: Apache-2.0\n"
ANCHOR = "def get_port_offset(dp_rank: int, tp_rank: int, tp_size: int = 1) -> int:\n"

CONFTEST = '''"""Builders."""

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

UNUSED_CONSTANT = 3
RANKS = (0, 1)


def make_offsets(tp_size: int) -> list[int]:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
        get_port_offset,
    )

    return [get_port_offset(0, r, tp_size) for r in range(tp_size)]


def never_used() -> None:
    raise AssertionError


@pytest.fixture
def tp_size() -> int:
    return len(RANKS)


@pytest.fixture(autouse=True)
def _cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
'''

TESTS = '''"""Patch 0001: port offsets are distinct per TP rank.

More words.
"""

from __future__ import annotations

import pytest
from conftest import make_offsets


def test_offsets_distinct(tp_size: int) -> None:
    offsets = make_offsets(tp_size)
    assert len(set(offsets)) == tp_size


@pytest.mark.parametrize("n", [1, 2])
def test_offsets_count(n: int) -> None:
    assert len(make_offsets(n)) == n
'''

TESTS_0002 = '''"""Port offsets stay stable."""

from conftest import make_offsets


def test_offsets_stable() -> None:
    assert make_offsets(2) == make_offsets(2)


def test_offsets_start_at_zero() -> None:
    assert make_offsets(1) == [0]
'''

TEST_IDS = [
    "tests/patches/test_0001_ports.py::test_offsets_distinct",
    "tests/patches/test_0001_ports.py::test_offsets_count",
]
TEST_0002 = "tests/patches/test_0002_stable.py::test_offsets_stable"
GUARD_0002 = "tests/patches/test_0002_stable.py::test_offsets_start_at_zero"
UPSTREAM_PR = "https://github.com/vllm-project/vllm/pull/1"
SIGNER = "Ada Lovelace <ada@example.org>"
PROJECT = "vllm-moriio-overlay <overlay@example.org>"


def _series(base: dict[str, str], *, line: str = "    # Ranks never share a port.\n"):
    common1 = edit(base[COMMON], ANCHOR, ANCHOR + line)
    conn = edit(
        base[CONNECTOR],
        "def is_moriio_available() -> bool:\n",
        "def is_moriio_available() -> bool:\n    # Checked once per process.\n",
    )
    common2 = edit(common1, ANCHOR + line, ANCHOR + line + "    # And stay stable.\n")
    return {
        "0001-port-offsets.patch": patch_text(
            "distinct port offsets per TP rank",
            [
                diff(COMMON, base[COMMON], common1),
                diff(CONNECTOR, base[CONNECTOR], conn),
            ],
            tests=" ".join(TEST_IDS),
        ),
        "0002-stable-offsets.patch": patch_text(
            "stable port offsets",
            [diff(COMMON, common1, common2)],
            tests=f"{TEST_0002}\nGuards: {GUARD_0002}",
        ),
    }


def _write_tests(root: Path) -> None:
    d = root / "tests" / "patches"
    d.mkdir(parents=True)
    (d / "conftest.py").write_text(CONFTEST)
    (d / "test_0001_ports.py").write_text(TESTS)
    (d / "test_0002_stable.py").write_text(TESTS_0002)


def _report(
    root: Path,
    *,
    base: str = "failed",
    series_id: str | None = None,
    count_owner: str = "0001-port-offsets.patch",
    guard_below: str = "passed",
    extra: Sequence[StackRow] = (),
) -> None:
    series = load_series(root)
    rows = [
        RevertRedRow(f"{TEST_IDS[0]}", "0001-port-offsets.patch", base, "passed"),
        RevertRedRow(f"{TEST_IDS[1]}[1]", count_owner, "failed", "passed"),
        RevertRedRow(f"{TEST_IDS[1]}[2]", count_owner, "error", "passed"),
        RevertRedRow(TEST_0002, "0002-stable-offsets.patch", "failed", "passed"),
        RevertRedRow(GUARD_0002, "", "passed", "passed"),
        RevertRedRow("tests/patches/test_other.py::test_x", "", "passed", "passed"),
    ]
    stack = [
        StackRow(TEST_IDS[0], "0001-port-offsets.patch", "test", base, "passed"),
        StackRow(f"{TEST_IDS[1]}[1]", count_owner, "test", "failed", "passed"),
        StackRow(f"{TEST_IDS[1]}[2]", count_owner, "test", "error", "passed"),
        StackRow(TEST_0002, "0002-stable-offsets.patch", "test", "failed", "passed"),
        StackRow(
            GUARD_0002, "0002-stable-offsets.patch", "guard", guard_below, "passed"
        ),
        *extra,
    ]
    report = RevertRedReport(
        PIN.vllm.version,
        series_id or series.series_id,
        "2026-11-29T13:00:00Z",
        rows,
        stack,
    )
    path = unit_base_report_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_report(report))


def _git_with_base(git: Path, base: dict[str, str]) -> Callable[..., str]:
    """A git repository at ``git`` holding the pinned MoRIIO files, committed;
    returns ``run(*git_args) -> stdout``."""
    git.mkdir()
    env = {"HOME": str(git), "PATH": "/usr/bin:/bin", "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip

    def run(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(git), *args], check=True, capture_output=True,
            text=True, env=env,
        ).stdout  # fmt: skip

    run("init", "-q")
    for path in (COMMON, CONNECTOR):
        (git / path).parent.mkdir(parents=True, exist_ok=True)
        (git / path).write_text(base[path])
    run("add", "-A")
    run("commit", "-qm", "base")
    return run


def _site(tmp_path: Path, base: dict[str, str]) -> Path:
    from tests.upstream.repos import write_tree

    return write_tree(tmp_path / "site", base)


@pytest.fixture
def site(tmp_path: Path, base_texts: dict[str, str]) -> Path:
    """A vLLM site tree holding the base files, to export from."""
    return _site(tmp_path, base_texts)


@pytest.fixture
def repo(make_repo: MakeRepo, base_texts: dict[str, str]) -> Path:
    root = make_repo(_series(base_texts))
    _write_tests(root)
    _report(root)
    return root


def _ruff() -> str:
    """ruff 0.14.0: $VLLM_OVERLAY_RUFF, next to this Python, or on PATH."""
    try:
        return find_ruff(None, CONFIG).exe
    except ExportError as e:
        pytest.fail(f"{e} (install ruff==0.14.0 in the test environment)")


def _export(
    root: Path, tmp_path: Path, base: dict[str, str], *names: str
) -> list[Path]:
    ctx = load_context(
        Checkout(root),
        BaseSource(tree=_site(tmp_path, base)),
        ruff=_ruff(),
        run_tests=False,
    )
    return export(ctx, list(names), root / "dist" / "upstream")


def test_bundle_for_a_standalone_patch(
    repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    written = _export(repo, tmp_path, base_texts)
    out = repo / "dist" / "upstream"
    assert sorted(p.relative_to(out).as_posix() for p in written) == [
        "0001-port-offsets/0001-port-offsets.patch",
        "0001-port-offsets/PR.md",
        "0001-port-offsets/checks.log",
        "0002-stable-offsets/0002-stable-offsets.patch",
        "0002-stable-offsets/PR.md",
        "0002-stable-offsets/checks.log",
    ]
    mail = (out / "0001-port-offsets" / "0001-port-offsets.patch").read_text()
    lines = mail.splitlines()
    assert re.fullmatch(r"From [0-9a-f]{40} Mon Sep 17 00:00:00 2001", lines[0])
    assert lines[1] == "From: overlay-tests <overlay-tests@users.noreply.github.com>"
    assert lines[2] == "Date: Sun, 29 Nov 2026 00:00:00 +0000"
    assert lines[3] == (
        "Subject: [PATCH] [Bugfix][ROCm][KVConnector] MoRIIO: distinct port offsets per"
    )
    assert " 3 files changed" in mail
    upstream_test = "tests/v1/kv_connector/unit/test_moriio_ports.py"
    assert f"create mode 100644 {upstream_test}" in mail
    # The same export twice gives the same bytes (fixed dates and ids).
    again = tmp_path / "again"
    again.mkdir()
    ctx = load_context(
        Checkout(repo),
        BaseSource(tree=_site(again, base_texts)),
        ruff=_ruff(),
        run_tests=False,
    )
    export(ctx, ["0001-port-offsets"], again / "out")
    assert (
        again / "out" / "0001-port-offsets" / "0001-port-offsets.patch"
    ).read_text() == mail

    # git itself (not our checker) applies the mail to the pinned files and
    # keeps the vLLM-style subject.
    git = tmp_path / "git"
    run = _git_with_base(git, base_texts)
    mbox = tmp_path / "m.patch"
    mbox.write_text(mail)
    run("am", "--keep-non-patch", str(mbox))
    assert run("log", "-1", "--format=%s") == (
        "[Bugfix][ROCm][KVConnector] MoRIIO: distinct port offsets per TP rank\n"
    )
    series = load_series(repo)
    for fp in series.patches[0].files:
        from vllm_overlay.series.diff import apply_file_patch

        assert (git / fp.path).read_text() == apply_file_patch(
            base_texts[fp.path], fp
        ).text
    ported = (git / upstream_test).read_text()
    assert ported.startswith(SPDX_HEADER)
    assert "conftest" not in ported
    assert "def make_offsets" in ported and "def tp_size" in ported
    assert "def _cpu" in ported  # autouse fixtures come along
    assert "never_used" not in ported and "UNUSED_CONSTANT" not in ported
    assert "RANKS = (0, 1)" in ported
    assert '"""Port offsets are distinct per TP rank.' in ported or (
        '"""Patch 0001: port offsets' in ported
    )
    for args in (["check"], ["format", "--check"]):
        lint = subprocess.run(
            [_ruff(), *args, "--config", str(CONFIG), "--no-cache", upstream_test],
            cwd=git, capture_output=True, text=True,
        )  # fmt: skip
        assert lint.returncode == 0, lint.stdout + lint.stderr

    body = (out / "0001-port-offsets" / "PR.md").read_text()
    for section in ("## Purpose", "## Root cause", "## Changes", "## Test Plan",
                    "## Test Result"):  # fmt: skip
        assert f"\n{section}\n" in f"\n{body}"
    assert "Root cause: the test needs one." not in body  # label stripped
    assert "\n\nThe test needs one.\n\n## Changes\n\nOne line.\n" in body
    assert f"pytest -v {upstream_test}" in body
    assert "| `test_offsets_distinct` | failed | passed |" in body
    assert "| `test_offsets_count[1]` | failed | passed |" in body
    assert "test_other" not in body
    assert "ruff 0.14.0" in body and "both pass" in body
    assert "2026-11-29T13:00:00Z" in body
    assert "applies on top of" not in body
    assert f"- `{COMMON}` (+1 −0): `get_port_offset`\n" in body
    assert f"- `{CONNECTOR}` (+1 −0): `is_moriio_available`\n" in body
    log = (out / "0001-port-offsets" / "checks.log").read_text()
    assert "[ok] applies to the pinned base alone as well" in log
    assert "[ok] the mail is made against the stack below: base" in log
    assert "[FAIL]" not in log


def test_dependent_patch_is_stacked_on_its_predecessor(
    repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    _export(repo, tmp_path, base_texts, "0002-stable-offsets.patch")
    d = repo / "dist" / "upstream" / "0002-stable-offsets"
    log = (d / "checks.log").read_text()
    assert "[ok] applies after its predecessors" in log
    assert "[ok] applies only after 0001-port-offsets.patch" in log
    assert "[ok] the mail is made against the stack below: base + 0001" in log
    body = (d / "PR.md").read_text()
    assert "This change applies on top of: 0001-port-offsets.patch" in body
    base = f"vLLM {PIN.vllm.version} ({PIN.vllm.git_commit})"
    assert f"| Test | {base} + 0001 | With this change |" in body
    assert "| `test_offsets_stable` | failed | passed |" in body
    assert "regression guards):\n- `test_offsets_start_at_zero`\n" in body
    assert "| `test_offsets_start_at_zero` | passed | passed |" in body
    mail = (d / "0002-stable-offsets.patch").read_text()
    assert "+    # And stay stable.\n" in mail
    # Stacked: the mail's context holds 0001's line.
    assert "\n     # Ranks never share a port.\n" in mail
    assert not (repo / "dist" / "upstream" / "0001-port-offsets").exists()


def test_no_report_no_export(
    repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    unit_base_report_path(repo).unlink()
    with pytest.raises(Exception, match=r"run `nox -s unit-base` first"):
        _export(repo, tmp_path, base_texts)
    _report(repo, series_id="0123456789ab")
    with pytest.raises(ExportError, match=r"series 0123456789ab, not the current"):
        _export(repo, tmp_path, base_texts)
    assert not (repo / "dist").exists()


def test_named_test_passing_on_the_base_stops_the_export(
    repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    _report(repo, base="passed")
    with pytest.raises(ExportError, match="test_offsets_distinct: passed below"):
        _export(repo, tmp_path, base_texts)
    _report(repo, guard_below="failed")
    with pytest.raises(ExportError, match="guard .*start_at_zero: failed below"):
        _export(repo, tmp_path, base_texts)
    assert not (repo / "dist").exists()


def test_test_file_shared_with_another_patch_stops_the_export(
    repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    # 0002 names a test that lives in 0001's test file.
    p1 = repo / "patches" / "0001-port-offsets.patch"
    p1.write_text(p1.read_text().replace(" ".join(TEST_IDS), TEST_IDS[0]))
    p2 = repo / "patches" / "0002-stable-offsets.patch"
    p2.write_text(p2.read_text().replace(TEST_0002, f"{TEST_0002} {TEST_IDS[1]}"))
    _report(repo, count_owner="0002-stable-offsets.patch")
    with pytest.raises(ExportError, match="also holds tests another patch names"):
        _export(repo, tmp_path, base_texts, "0001-port-offsets.patch")
    assert not (repo / "dist").exists()


def test_ruff_failure_stops_the_export(
    make_repo: MakeRepo, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    long_line = "    x = " + "1 + " * 30 + "1  # too long for vLLM's 88 columns\n"
    root = make_repo(_series(base_texts, line=long_line))
    _write_tests(root)
    _report(root)
    with pytest.raises(
        ExportError,
        match=r"0001-port-offsets.patch: ruff check fails: .*common.py:\d+:89: E501",
    ):
        _export(root, tmp_path, base_texts)
    assert not (root / "dist").exists()


def test_oversized_body_and_bad_subject(
    make_repo: MakeRepo, tmp_path: Path, base_texts: dict[str, str], repo: Path
) -> None:
    patches = _series(base_texts)
    name = "0001-port-offsets.patch"
    huge = "".join(f" Root cause detail {i} " + "x" * 80 + "\n" for i in range(800))
    patches[name] = patches[name].replace(
        " Changes: one line.\n", " Changes: one line.\n .\n" + huge
    )
    root = repo.parent / "big"
    (root / "patches").mkdir(parents=True)
    shutil.copytree(repo / "ci", root / "ci")
    (root / "pin.toml").write_text((repo / "pin.toml").read_text())
    (root / "patches" / "series").write_text("".join(f"{n}\n" for n in patches))
    for n, t in patches.items():
        (root / "patches" / n).write_text(t)
    _write_tests(root)
    _report(root)
    with pytest.raises(ExportError, match=r"PR body is \d+ characters, over 65536"):
        _export(root, tmp_path, base_texts, name)
    text = (root / "patches" / name).read_text()
    (root / "patches" / name).write_text(
        text.replace(
            "Description: [Bugfix][ROCm][KVConnector] MoRIIO: ", "Description: "
        )
    )
    _report(root)
    with pytest.raises(ExportError, match="not '\\[Tag\\]... Title'"):
        _export(root, tmp_path, base_texts, name)


def test_cli_export_and_run_tests_on_the_stack(
    monkeypatch: pytest.MonkeyPatch,
    repo: Path,
    site: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(repo.parent)  # a relative --repo, as `--repo .` gives
    argv = ["--repo", repo.name, "export", "--from", str(site), "--ruff", _ruff()]
    argv += ["--signoff", SIGNER]
    assert main([*argv, "--patch", "0001-port-offsets"]) == 0
    out = capsys.readouterr().out
    assert "export: 1 bundle in" in out
    # The ported tests run alone, with the MoRIIO package of the stack with
    # the patch: this Python's vLLM need not carry the test series.
    assert main([*argv, "--run-tests", "--patch", "0002-stable-offsets"]) == 0
    log = (repo / "dist/upstream/0002-stable-offsets/checks.log").read_text()
    assert "[ok] ported tests ran alone (no conftest) on base + 0001..0002: " in log
    assert "2 passed" in log


def test_every_bundle_applies_with_git_am_onto_the_stack_below(
    make_repo: MakeRepo, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    """An upstream pull request, then an extension of ours building on it: one
    bundle each, in stack order; git itself applies them in order onto the
    pinned files, each giving that stack level; the extension's PR body names
    the pull request it builds on."""
    patches = _series(base_texts)
    first, second = patches
    patches[first] = (
        patches[first]
        .replace("Origin: vendor\n", f"Origin: upstream, {UPSTREAM_PR}\n")
        .replace("Forwarded: no\n", f"Forwarded: {UPSTREAM_PR}\n")
    )
    patches[second] = (
        patches[second]
        .replace("Remove-When:", f"Builds-On: {UPSTREAM_PR}\nRemove-When:")
        .replace(f"Guards: {GUARD_0002}", f"Guards: {GUARD_0002} {TEST_IDS[0]}")
    )
    root = make_repo(patches)
    _write_tests(root)
    # 0002 also guards a test of 0001's file: it keeps passing.
    guard = StackRow(TEST_IDS[0], second, "guard", "passed", "passed")
    _report(root, extra=[guard])
    written = _export(root, tmp_path, base_texts)
    out = root / "dist" / "upstream"
    assert sorted({p.parent.name for p in written}) == [
        "0001-port-offsets",
        "0002-stable-offsets",
    ]
    for name in ("0001-port-offsets", "0002-stable-offsets"):
        log = (out / name / "checks.log").read_text()
        assert "[ok] git am of bundles 1..2 in order onto the pinned base" in log
    body = (out / "0002-stable-offsets" / "PR.md").read_text()
    assert f"This extends #1 ({UPSTREAM_PR}) (0001-port-offsets.patch)" in body
    # The guard from 0001's file goes by its upstream name.
    upstream_0001 = "tests/v1/kv_connector/unit/test_moriio_ports.py"
    assert f"| `{upstream_0001}::test_offsets_distinct` | passed | passed |" in body

    git = tmp_path / "git"
    run = _git_with_base(git, base_texts)
    series = load_series(root)
    from vllm_overlay.series.diff import apply_file_patch

    level = dict(base_texts)
    for patch in series.patches:
        run("am", "--keep-non-patch", str(out / patch.slug / f"{patch.slug}.patch"))
        for fp in patch.files:
            level[fp.path] = apply_file_patch(level[fp.path], fp).text
        for path in (COMMON, CONNECTOR):
            assert (git / path).read_text() == level[path], (patch.name, path)
    assert run("log", "--format=%an", "-2").splitlines() == [
        "overlay-tests",
        "overlay-tests",
    ]


def test_identity_and_ruff_version(tmp_path: Path) -> None:
    assert (
        str(Identity.parse("MIR-AMD")) == "MIR-AMD <MIR-AMD@users.noreply.github.com>"
    )
    assert str(Identity.parse("A B <a@b.org>")) == "A B <a@b.org>"
    fake = tmp_path / "ruff"
    fake.write_text("#!/bin/sh\necho ruff 0.6.0\n")
    fake.chmod(0o755)
    with pytest.raises(ExportError, match="is ruff 0.6.0; export needs ruff 0.14.0"):
        find_ruff(str(fake), CONFIG)


def test_pin_fixture_is_the_real_pin(pin: Pin) -> None:
    assert pin == PIN


def _no_git_identity(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(home / "none"))
    for var in ("GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):
        monkeypatch.delenv(var, raising=False)


def test_export_without_an_identity_to_sign_off_with_stops(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    repo: Path,
    site: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _no_git_identity(monkeypatch, tmp_path / "home")
    argv = ["--repo", str(repo), "export", "--from", str(site), "--ruff", _ruff()]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "vLLM's DCO check needs a Signed-off-by" in err
    assert "--signoff 'Name <email>'" in err
    assert not (repo / "dist").exists()
    # The git identity is the default; --no-signoff is a choice, said in the log.
    monkeypatch.setenv("GIT_COMMITTER_NAME", "Ada Lovelace")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "ada@example.org")
    assert main([*argv, "--patch", "0001-port-offsets"]) == 0
    d = repo / "dist" / "upstream" / "0001-port-offsets"
    assert f"\nSigned-off-by: {SIGNER}\n" in (d / "0001-port-offsets.patch").read_text()
    assert main([*argv, "--no-signoff", "--patch", "0001-port-offsets"]) == 0
    assert "Signed-off-by" not in (d / "0001-port-offsets.patch").read_text()
    assert "[--] no Signed-off-by (--no-signoff)" in (d / "checks.log").read_text()


def _run_hint(log: str, git: Path, run: Callable[..., str]) -> None:
    """The hint's `git am` lines, run in a clone holding the pinned files
    (the checkout of the pinned commit and the push need vLLM's history)."""
    lines = [ln.strip() for ln in log.splitlines()]
    start = next(
        i for i, ln in enumerate(lines) if ln.startswith("open it, in a clone")
    )
    hint = lines[start + 1 :]
    assert hint[0].startswith("git checkout -b moriio/") and hint[0].endswith(
        f" {PIN.vllm.git_commit}"
    )
    assert hint[-2].startswith("git push -u <your-fork> moriio/")
    assert hint[-1].startswith("gh pr create --repo vllm-project/vllm --title ")
    for line in hint:
        if line.startswith("git am "):
            run(*shlex.split(line)[1:])
    body_file = Path(shlex.split(hint[-1])[-1])
    assert body_file.is_absolute() and body_file.name == "PR.md" and body_file.is_file()


def test_mails_are_dco_ready_and_the_hint_is_the_whole_sequence(
    make_repo: MakeRepo, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    """Our own patch (Author: vllm-moriio-overlay) is authored and signed off
    by the exporter, as vLLM's DCO check wants; someone else's keeps its
    author, gets the exporter's sign-off and says theirs is needed too. The
    hint's commands apply the mails with git."""
    patches = _series(base_texts)
    first, second = patches
    patches[second] = patches[second].replace(
        "Author: overlay-tests\n", f"Author: {PROJECT}\n"
    )
    root = make_repo(patches)
    _write_tests(root)
    _report(root)
    ctx = load_context(
        Checkout(root),
        BaseSource(tree=_site(tmp_path, base_texts)),
        ruff=_ruff(),
        run_tests=False,
        signoff=Identity.parse(SIGNER),
    )
    out = root / "dist" / "upstream"
    export(ctx, [], out)
    ours = (out / "0002-stable-offsets" / "0002-stable-offsets.patch").read_text()
    assert f"\nFrom: {SIGNER}\n" in ours
    assert ours.count("Signed-off-by:") == 1
    log_ours = (out / "0002-stable-offsets" / "checks.log").read_text()
    assert f"[ok] DCO: Signed-off-by: {SIGNER}, the mail's author" in log_ours
    theirs = (out / "0001-port-offsets" / "0001-port-offsets.patch").read_text()
    assert "\nFrom: overlay-tests <overlay-tests@users.noreply.github.com>\n" in theirs
    log_theirs = (out / "0001-port-offsets" / "checks.log").read_text()
    assert "also wants the author's own sign-off (overlay-tests" in log_theirs

    git = tmp_path / "git"
    run = _git_with_base(git, base_texts)
    # 0002 applies only on top of 0001: its hint applies 0001's mail first.
    _run_hint(log_ours, git, run)
    assert run("log", "--format=%an|%(trailers:key=Signed-off-by,valueonly)", "-2") == (
        f"Ada Lovelace|{SIGNER}\n\noverlay-tests|{SIGNER}\n\n"
    )


def test_the_number_that_chooses_a_patch_is_its_file_s(
    repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    """A series with a number left out: "0007" is the second patch."""
    patches = repo / "patches"
    (patches / "0002-stable-offsets.patch").rename(
        patches / "0007-stable-offsets.patch"
    )
    series = patches / "series"
    series.write_text(series.read_text().replace("0002-stable", "0007-stable"))
    _report(repo)
    report = repo / ".nox-reports" / "unit-base.json"
    report.write_text(report.read_text().replace("0002-stable", "0007-stable"))
    written = _export(repo, tmp_path, base_texts, "0007")
    assert {p.parent.name for p in written} == {"0007-stable-offsets"}
    with pytest.raises(ExportError, match="^not in the series: 0002 "):
        _export(repo, tmp_path, base_texts, "0002")


def test_a_patch_is_chosen_by_its_number_and_an_unknown_one_lists_the_series(
    repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    written = _export(repo, tmp_path, base_texts, "0002")
    assert {p.parent.name for p in written} == {"0002-stable-offsets"}
    with pytest.raises(ExportError) as e:
        _export(repo, tmp_path, base_texts, "0009")
    assert str(e.value) == (
        "not in the series: 0009 (the series: 0001-port-offsets, 0002-stable-offsets)"
    )


def _project_series(make_repo: MakeRepo, base_texts: dict[str, str]) -> Path:
    """0001 someone else's (a GitHub handle), 0002 this project's."""
    patches = _series(base_texts)
    second = "0002-stable-offsets.patch"
    patches[second] = patches[second].replace(
        "Author: overlay-tests\n", f"Author: {PROJECT}\n"
    )
    root = make_repo(patches)
    _write_tests(root)
    _report(root)
    return root


def test_pr_body_has_vllms_template_checklist_and_says_whose_change_it_is(
    make_repo: MakeRepo, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    root = _project_series(make_repo, base_texts)
    _export(root, tmp_path, base_texts)
    out = root / "dist" / "upstream"
    theirs = (out / "0001-port-offsets" / "PR.md").read_text()
    lines = theirs.splitlines()
    assert lines[0] == "## Essential Elements of an Effective PR Description Checklist"
    assert lines[2].startswith("- [x] The purpose of the PR")
    assert lines[3] == "- [x] The test plan, such as providing test command."
    assert lines[5].startswith("- [ ] (Optional) The necessary documentation")
    headings = [ln for ln in lines if ln.startswith("## ")]
    assert headings[1:2] == ["## Purpose"]
    assert headings.index("## Test Plan") < headings.index("## Test Result")
    # Someone else's change: theirs to sign off; its noreply address is a
    # guess the bundle names as one (no account ID is made up).
    note = "this change is overlay-tests's"
    assert note in theirs and "ID+handle@users.noreply.github.com" in theirs
    log = (out / "0001-port-offsets" / "checks.log").read_text()
    assert f"[--] Authorship: {note}" in log
    assert "does not know and does not make up" in log
    ours = (out / "0002-stable-offsets" / "PR.md").read_text()
    assert "Authorship:" not in ours
    assert "Authorship:" not in (out / "0002-stable-offsets" / "checks.log").read_text()


def test_our_patches_mail_from_the_project_address_without_a_signoff(
    make_repo: MakeRepo, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    root = _project_series(make_repo, base_texts)
    _export(root, tmp_path, base_texts, "0002")
    mail = root / "dist" / "upstream" / "0002-stable-offsets"
    assert f"\nFrom: {PROJECT}\n" in (mail / "0002-stable-offsets.patch").read_text()


@pytest.mark.parametrize(
    ("tags", "message"),
    [
        (
            "[KV Connector][ROCm]",
            r"title tag \[KV Connector\]: vLLM writes \[KVConnector\]",
        ),
        ("[ROCm][Overlay]", r"title tag \[Overlay\] is not one vLLM's MoRIIO"),
    ],
)
def test_a_title_tag_vllm_does_not_use_stops_the_export(
    make_repo: MakeRepo,
    tmp_path: Path,
    base_texts: dict[str, str],
    tags: str,
    message: str,
) -> None:
    patches = _series(base_texts)
    name = "0001-port-offsets.patch"
    patches[name] = patches[name].replace("[Bugfix][ROCm][KVConnector]", tags, 1)
    root = make_repo(patches)
    _write_tests(root)
    _report(root)
    with pytest.raises(ExportError, match=message):
        _export(root, tmp_path, base_texts, "0001")
    assert not (root / "dist").exists()
