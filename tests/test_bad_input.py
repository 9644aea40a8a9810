"""Bad input, tried as a user would: every error is one line on stderr and
exit status 2 (with --json, also one JSON object on stdout), no traceback,
and the tree is left exactly as it was. Issue 15's defect groups 3-5 and 7.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faketree import BASE_TEXTS, COMMON, CONNECTOR, FakeTree, json_of
from tests.repo import REPO
from tests.workspace import make_diff
from vllm_overlay import safefile
from vllm_overlay.cli import main
from vllm_overlay.safefile import MAX_READ_BYTES
from vllm_overlay.series.pin import MODULE_DIR, PIN_FILE
from vllm_overlay.transaction import LOCK_NAME
from vllm_overlay.tree.manifest import MANIFEST_NAME


def _one_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], *, json_too: bool = True
) -> str:
    """Run ``argv`` (and again with --json): status 2, one line on stderr,
    the same error as a JSON object on stdout. Returns the line."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    if json_too:
        assert main(["--json", *argv]) == 2
        out, err_json = capsys.readouterr()
        assert json_of(out) == {"error": err[len("error: ") :].rstrip("\n")}
        assert err_json == err
    return err


@pytest.fixture
def tree(tmp_path: Path) -> FakeTree:
    return FakeTree.create(tmp_path)


def _overlaid(tree: FakeTree) -> FakeTree:
    assert tree.cli("apply") == 0
    return tree


@pytest.fixture(params=["apply", "revert"])
def overlaid_command(request: pytest.FixtureRequest, tree: FakeTree) -> str:
    """``apply`` or ``revert``, to run on ``tree`` once it is overlaid."""
    _overlaid(tree)
    return request.param


# -- 3: tracebacks that are now one line ----------------------------------------


def test_non_utf8_byte_in_an_overlaid_file(
    tree: FakeTree, capsys: pytest.CaptureFixture[str], overlaid_command: str
) -> None:
    path = tree.site / CONNECTOR
    path.chmod(0o644)
    path.write_bytes(path.read_bytes().replace(b"line 7", b"line \xff"))
    before = tree.snapshot()
    err = _one_error(capsys, tree.argv(overlaid_command))
    assert "not UTF-8 text" in err and "moriio_connector.py" in err
    assert tree.snapshot() == before
    # status reports it, in text and as JSON, and exits 1.
    assert tree.cli("status") == 1
    assert "not UTF-8 text" in capsys.readouterr().out
    assert main(["--json", *tree.argv("status")]) == 1
    report = json_of(capsys.readouterr().out)
    assert report["state"] == "unknown"


def test_non_utf8_byte_in_a_patch(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    patch = tree.repo / "patches" / "0002-connector.patch"
    patch.write_bytes(patch.read_bytes().replace(b"# 0002", b"# \xfe002"))
    before = tree.snapshot()
    assert main(["--repo", str(tree.repo), "series", "check"]) == 2
    out = capsys.readouterr().out
    assert "0002-connector.patch: not UTF-8 text" in out
    err = _one_error(capsys, tree.argv("apply"))
    assert "0002-connector.patch: not UTF-8 text" in err
    assert tree.snapshot() == before


def test_patch_retargeted_to_an_unpinned_path(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    patch = tree.repo / "patches" / "0002-connector.patch"
    patch.write_text(patch.read_text().replace("moriio_connector.py", "moriio_x.py"))
    before = tree.snapshot()
    err = _one_error(capsys, tree.argv("apply"))
    assert "moriio_x.py, which is not pinned" in err
    assert tree.snapshot() == before


def test_directory_at_the_manifest_path(
    tree: FakeTree, capsys: pytest.CaptureFixture[str], overlaid_command: str
) -> None:
    manifest = tree.module / MANIFEST_NAME
    manifest.unlink()
    manifest.mkdir()
    before = tree.snapshot()
    err = _one_error(capsys, tree.argv(overlaid_command))
    assert f"{MANIFEST_NAME}: is a directory" in err
    assert tree.snapshot() == before
    assert tree.cli("status") == 1
    assert "manifest: invalid: a directory stands at its path" in (
        capsys.readouterr().out
    )


def test_manifest_whose_patch_text_is_not_a_diff(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    _overlaid(tree)
    overlaid = tree.snapshot()
    manifest = tree.module / MANIFEST_NAME
    data = json.loads(manifest.read_text())
    data["patches"][0]["text"] = "Subject: x\n---\nnot a diff\n"
    manifest.write_text(json.dumps(data))
    assert tree.cli("status") == 1
    out = capsys.readouterr().out
    assert "manifest: invalid: 0001-both.patch as recorded is not a patch" in out
    assert tree.cli("apply") == 0  # the bytes are the overlay: repaired
    assert "rewrote the manifest" in capsys.readouterr().out
    assert tree.snapshot() == overlaid


@pytest.mark.parametrize(
    ("case", "make_args"),
    [
        ("missing wheel", lambda t: ["--wheel", str(t / "nope.whl")]),
        ("out is a file", lambda t: ["--out", str(t / "afile")]),
        ("out not writable", lambda t: ["--out", "/proc/vllm-overlay-test"]),
    ],
)
def test_materialize_bad_paths(
    tree: FakeTree,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    make_args: Callable[[Path], list[str]],
) -> None:
    (tmp_path / "afile").write_text("x")
    args = make_args(tmp_path)
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    else:
        args += ["--from", str(tree.vllm)]
    err = _one_error(capsys, ["--repo", str(tree.repo), "materialize", *args])
    assert ("cannot read the wheel" if case == "missing wheel" else "--out ") in err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--lengths", "x"], "--lengths 'x': 'x' is not a length, a range a-b"),
        (
            ["--lengths", "0-10"],
            "--lengths '0-10': a prompt length is at least 1, not 0",
        ),
        (["--lengths", "5,10-5"], "--lengths '5,10-5': a range a-b needs a <= b"),
        (["--lengths", "1-9/0"], "--lengths '1-9/0': a step is at least 1, not 0"),
        (["--lengths", ","], "--lengths ',': no length given"),
        (["--layouts", "nope"], "--layouts 'nope'"),
        (["--hits", "500"], "--hits '500': a hit is 0 to 100 %, not 500"),
        (["--hits", "half"], "--hits 'half': 'half' is not a percentage"),
        (["--processes", "0"], "--processes 0: must be at least 1"),
        (["--bytes", "--processes", "-1"], "--processes -1: must be at least 1"),
    ],
)
def test_simulate_bad_arguments(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    err = _one_error(capsys, ["--repo", str(REPO), "simulate", *args])
    assert says in err


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_error(capsys, ["status", "--bogus"])
    assert "unrecognized arguments: --bogus" in err
    err = _one_error(capsys, ["--repo", "/nonexistent/repo", "status"])
    assert "/nonexistent/repo: no such directory" in err


@pytest.mark.parametrize(
    ("argv", "help_of"),
    [
        (["status", "--bogus"], "vllm-overlay status"),
        (["--bogus", "status"], "vllm-overlay status"),
        (["series", "check", "--bogus"], "vllm-overlay series check"),
        (["materialize"], "vllm-overlay materialize"),
        (["series"], "vllm-overlay series"),
    ],
)
def test_a_usage_error_points_at_the_subcommands_help(
    capsys: pytest.CaptureFixture[str], argv: list[str], help_of: str
) -> None:
    # An unknown argument and a missing one both point at the help of the
    # command they were given to.
    err = _one_error(capsys, argv)
    assert err.endswith(f"(see `{help_of} --help`)\n"), err


def test_broken_pipe_is_quiet(tree: FakeTree) -> None:
    """Output piped to a reader that has gone (`| head`): no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_overlay.cli", *tree.argv("status")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 2
    assert err == ""


def test_sigint_at_the_first_step_is_one_line(tree: FakeTree) -> None:
    """Ctrl-C as the write starts (before the journal exists)."""
    run = tree.kill_at("apply", 1, "SIGINT")
    assert run.returncode == 2
    assert run.stderr == "error: interrupted by SIGINT; every file was restored\n"


# -- 4: the pin's paths ----------------------------------------------------------


def test_pinned_path_escaping_the_module_is_refused(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    escape = f"{MODULE_DIR}/../../../escape.txt"
    pin = tree.repo / PIN_FILE
    entry = f'"{escape}" = "{"0" * 64}"'
    pin.write_text(pin.read_text().replace("[files]", f"[files]\n{entry}"))
    before = tree.snapshot()
    err = _one_error(capsys, tree.argv("apply"))
    assert "is not a normalised relative path" in err
    assert tree.snapshot() == before
    assert not (tree.site / "vllm" / "distributed" / "escape.txt").exists()


# -- 5: sections of a diff that are not text hunks ------------------------------

GIT = "diff --git a/{p} b/{p}\n"
NOT_TEXT = {
    "git binary patch": GIT
    + "index 1..2 100644\nGIT binary patch\nliteral 1\nAcmZ\n\n",
    "binary files differ": GIT + "index 1..2\nBinary files a/{p} and b/{p} differ\n",
    "mode change": GIT + "old mode 100644\nnew mode 100755\n",
    "rename": GIT + "similarity index 100%\nrename from {p}\nrename to {p}.py\n",
}


@pytest.mark.parametrize("kind", sorted(NOT_TEXT))
def test_non_text_section_is_refused_by_check_and_apply(
    tree: FakeTree, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    patch = tree.repo / "patches" / "0002-connector.patch"
    patch.write_text(patch.read_text() + NOT_TEXT[kind].format(p=COMMON))
    before = tree.snapshot()
    assert main(["--repo", str(tree.repo), "series", "check"]) == 2
    out = capsys.readouterr().out
    assert "0002-connector.patch: not a unified diff" in out
    assert "only text hunks" in out or "no text hunks" in out
    _one_error(capsys, tree.argv("apply"))
    assert tree.snapshot() == before


# -- 7: what else a user meets ---------------------------------------------------


def test_status_json_on_error_is_an_object(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    (tree.repo / PIN_FILE).write_text("[vllm\n")
    err = _one_error(capsys, tree.argv("status"))
    assert "not valid TOML" in err


def test_apply_json_reports_what_it_did(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--json", *tree.argv("apply")]) == 0
    out = json_of(capsys.readouterr().out)
    assert out["action"] == "applied"
    assert out["files"] == [COMMON, CONNECTOR]


def test_stray_file_in_the_module_does_not_block_revert(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    _overlaid(tree)
    (tree.module / "moriio_extra.py").write_text("x = 1\n")
    capsys.readouterr()
    assert tree.cli("status") == 1
    out = capsys.readouterr().out
    assert "unknown  (not in the pin)" in out
    assert "expected sha256 ," not in out and "expected -" not in out
    assert tree.cli("revert") == 0
    out = capsys.readouterr().out
    assert "warning: " + f"{MODULE_DIR}/moriio_extra.py: not in the pin" in out
    assert (tree.site / CONNECTOR).read_text() == BASE_TEXTS[CONNECTOR]


@pytest.mark.parametrize(
    "entry", ["0001-both.patch", "../0001-both.patch", ".hidden.patch"]
)
def test_series_check_problem_stops_apply(
    tree: FakeTree, capsys: pytest.CaptureFixture[str], entry: str
) -> None:
    with (tree.repo / "patches" / "series").open("a") as f:
        f.write(entry + "\n")
    before = tree.snapshot()
    assert main(["--repo", str(tree.repo), "series", "check"]) == 2
    capsys.readouterr()
    err = _one_error(capsys, tree.argv("apply"))
    assert "more than once" in err or "must be a .patch file in patches/" in err
    assert tree.snapshot() == before


def test_rollback_keeps_modes(tree: FakeTree) -> None:
    """A failed write restores 444 as 444 (it became 644 before)."""
    from vllm_overlay import transaction

    before = tree.snapshot()
    assert before[Path(CONNECTOR).name][1] == 0o444

    def fail(step: str) -> None:
        if step == f"rename {Path(CONNECTOR).name}":
            raise PermissionError(13, "Permission denied", step)

    transaction._fault_hook = fail
    try:
        assert tree.cli("apply") == 2
    finally:
        transaction._fault_hook = None
    assert tree.snapshot() == before


def test_edited_patch_after_apply_names_its_file(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    """A header-less diff (no `---` line) is a series error, not a crash."""
    (tree.repo / "patches" / "0002-connector.patch").write_text(
        make_diff(CONNECTOR, "a\n", "b\n")
    )
    err = _one_error(capsys, tree.argv("apply"))
    assert "0002-connector.patch" in err


# -- issue 41: success stays success; what is too large or cannot be written ----


@pytest.mark.parametrize("json_out", [False, True])
@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_undecodable_file_name_does_not_turn_a_done_apply_into_an_error(
    tree: FakeTree, tmp_path: Path, encoding: str, json_out: bool
) -> None:
    """A file whose name is not UTF-8 in the module: apply overlays the tree
    and says so (exit 0), the name shown with escapes, whatever the output
    encoding; it used to end in `internal error: UnicodeEncodeError`."""
    reference = FakeTree.create(tmp_path / "reference")
    assert reference.cli("apply") == 0
    odd = os.fsencode(tree.module) + b"/moriio_\xff.py"
    with open(odd, "wb") as f:
        f.write(b"x = 1\n")
    argv = ["--json"] if json_out else []
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_overlay.cli", *argv, *tree.argv("apply")],
        cwd=REPO,
        env={**os.environ, "PYTHONIOENCODING": encoding},
        capture_output=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stderr) == (0, b"")
    out = proc.stdout.decode(encoding)
    warning = f"{MODULE_DIR}/moriio_\\xff.py: not in the pin; left as it is"
    if json_out:
        result = json_of(out)
        assert result["action"] == "applied"
        assert result["warnings"] == [warning]
    else:
        assert f"  warning: {warning}\n" in out
        assert out.endswith("apply: applied: 2 patches (series b7d30efe253e)\n")
    now = {k: v for k, v in tree.snapshot().items() if "moriio_" + "\udcff" not in k}
    assert now == reference.snapshot()


def test_pinned_file_over_the_size_cap_is_refused_unread(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    """6 MB where a pinned file stands: one line naming the file, its size
    and the cap, checked before reading (it used to take seconds and a
    hundred MB to say it matched nothing)."""
    path = tree.site / CONNECTOR
    path.chmod(0o644)
    os.truncate(path, 6 << 20)
    before = tree.snapshot()
    err = _one_error(capsys, tree.argv("apply"))
    assert err == (
        f"error: {CONNECTOR}: {6 << 20} bytes, larger than the {MAX_READ_BYTES}-"
        "byte cap on a pinned file; nothing was written\n"
    )
    assert tree.snapshot() == before
    assert tree.cli("status") == 1
    assert f"larger than the {MAX_READ_BYTES}-byte cap" in capsys.readouterr().out


def test_lock_that_cannot_be_written_says_which_and_what(
    tree: FakeTree, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk when the pid goes into the lock: the error names the lock
    and what failed (it used to be a bare `No space left on device`)."""

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    before = tree.snapshot()
    err = _one_error(capsys, tree.argv("apply"))
    assert err == (
        f"error: cannot write this process's pid into the lock "
        f"{tree.module / LOCK_NAME}: No space left on device; nothing was written\n"
    )
    assert tree.snapshot() == before
    assert not (tree.module / LOCK_NAME).exists()


def test_replace_file_replaces_a_symlink_and_leaves_its_target(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep")
    link = tmp_path / "report.json"
    link.symlink_to(target)
    safefile.replace_file(link, b"{}\n")
    assert target.read_text() == "keep"
    assert not link.is_symlink() and link.read_bytes() == b"{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious", "report.json"]


@pytest.mark.parametrize("command", ["suite", "levels", "removable"])
@pytest.mark.parametrize("jobs", ["-1", "two"])
def test_jobs_is_a_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, jobs: str
) -> None:
    """`--jobs` takes 1 or more (0: one per core); anything else is one
    line, and nothing is run or written."""
    out = tmp_path / "out"
    err = _one_error(
        capsys, [command, "--out", str(out), "--jobs", jobs], json_too=False
    )
    assert f"--jobs: '{jobs}': how many at a time, 1 or more" in err
    assert not out.exists()
