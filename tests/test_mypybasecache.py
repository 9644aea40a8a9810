"""The pinned base's mypy errors, kept per wheel, mypy and settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest

from tests.repo import REPO
from vllm_overlay.cli import main as cli_main
from vllm_overlay.mypybase import (
    MypyError,
    base_key,
    format_errors,
    parse_errors,
    settings_sha256,
)
from vllm_overlay.mypybasecache import BaseErrors, CachedError, lookup, main, store
from vllm_overlay.series.patch_series import load_series

CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
REPORT = (
    f'{CONNECTOR}:941: error: Need type annotation for "ctx"  [var-annotated]\n'
    f"{CONNECTOR}:2797: error: Unsupported operand types for / "
    '("None" and "int")  [operator]\n'
    f'{CONNECTOR}:2797: note: Left operand is of type "int | None"\n'
    "Found 2 errors in 1 file (checked 2 source files)\n"
)
SHA = "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"


def _entry(settings: str = "ab" * 32) -> BaseErrors:
    errors = [CachedError(e.path, e.code, e.message) for e in parse_errors(REPORT)]
    return BaseErrors(SHA, "2.4.1", settings, [CONNECTOR], errors)


def test_the_key_changes_with_the_wheel_mypy_and_every_setting() -> None:
    files, env = [CONNECTOR], ["pydantic==2.14.4", "torch==2.13.0"]
    settings = settings_sha256("[tool.mypy]", "3.11", files, env)
    key = base_key(SHA, "2.4.1", settings)
    others = {
        base_key("0" * 64, "2.4.1", settings),
        base_key(SHA, "2.5.0", settings),
        base_key(SHA, "2.4.1", settings_sha256("[tool.mypy]\nx=1", "3.11", files, env)),
        base_key(SHA, "2.4.1", settings_sha256("[tool.mypy]", "3.12", files, env)),
        base_key(SHA, "2.4.1", settings_sha256("[tool.mypy]", "3.11", [], env)),
        base_key(SHA, "2.4.1", settings_sha256("[tool.mypy]", "3.11", files, env[:1])),
    }
    assert key not in others and len(others) == 6
    assert settings_sha256("[tool.mypy]", "3.11", files, env) == settings


def test_cached_errors_read_back_as_the_report_mypy_printed() -> None:
    errors = parse_errors(REPORT)
    assert parse_errors(format_errors(errors)) == errors
    assert _entry().mypy_errors() == errors


def test_a_stored_entry_is_found_by_its_key(tmp_path: Path) -> None:
    entry = _entry()
    path = store(tmp_path / "ci", entry)
    assert path.name == f"{entry.key}.json"
    found, line = lookup([tmp_path / "ci", tmp_path / "local"], entry.key)
    assert found == entry
    assert "2 error(s) from" in line and "mypy not run on the base" in line


def test_a_missing_key_names_the_entries_there_are(tmp_path: Path) -> None:
    other = _entry()
    store(tmp_path, other)
    key = _entry("cd" * 32).key
    found, line = lookup([tmp_path], key)
    assert found is None
    assert f"no cached base errors for {key} (no entry" in line
    assert other.key in line and "mypy runs on the base" in line


def test_an_entry_holding_another_key_is_stale_and_not_used(tmp_path: Path) -> None:
    wanted, held = _entry("cd" * 32), _entry()
    (tmp_path / f"{wanted.key}.json").write_bytes(store(tmp_path, held).read_bytes())
    found, line = lookup([tmp_path], wanted.key)
    assert found is None
    assert f"{wanted.key}.json is stale (it holds key {held.key})" in line


@pytest.mark.parametrize(
    "text", ["{not json", '{"wheel_sha256": "x"}', '{"errors": [], "extra": 1}']
)
def test_an_unreadable_entry_is_not_used_and_the_next_directory_is(
    tmp_path: Path, text: str
) -> None:
    entry = _entry()
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / f"{entry.key}.json").write_text(text)
    found, line = lookup([tmp_path / "ci"], entry.key)
    assert found is None and "is unreadable" in line
    store(tmp_path / "local", entry)
    found, _ = lookup([tmp_path / "ci", tmp_path / "local"], entry.key)
    assert found == entry


def test_put_then_get_through_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, out = tmp_path / "base.txt", tmp_path / "got.txt"
    report.write_text(REPORT)
    fields = ["--wheel-sha256", SHA, "--mypy-version", "2.4.1"]
    fields += ["--settings-sha256", "ab" * 32]
    put = ["put", "--dir", str(tmp_path / "d"), "--report", str(report)]
    assert main([*put, *fields, CONNECTOR]) == 0
    assert "2 error(s) recorded in" in capsys.readouterr().out
    get = ["get", "--key", _entry().key, "--dir", str(tmp_path / "d")]
    assert main([*get, "--out", str(out)]) == 0
    assert parse_errors(out.read_text()) == parse_errors(REPORT)
    # A key with no entry leaves no report behind: the base is checked.
    assert (
        main(["get", "--key", "other", "--dir", str(tmp_path), "--out", str(out)]) == 0
    )
    assert not out.exists()
    assert "no cached base errors for other" in capsys.readouterr().out


def _noxlint() -> ModuleType:
    """ci/noxlint.py, its `nox` a stand-in (nox is not installed here)."""
    names = ("ci.noxlint", "ci.noxenv")
    with mock.patch.dict(sys.modules, {"nox": mock.MagicMock()}):
        for name in names:
            sys.modules.pop(name, None)
        from ci import noxlint

        for name in names:
            sys.modules.pop(name, None)
    return noxlint


def test_a_clone_finds_the_pinned_base_errors_committed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`nox -s lint` runs mypy on the overlaid files only: the pinned base's
    errors for this checkout's wheel, mypy and settings are in
    ci/mypy-base-errors/ (lint writes a missing entry to
    .nox-cache/mypy-base-errors/ and says how to commit it)."""
    nox_module = _noxlint()
    # The files lint checks: `series check --json` lists them.
    assert cli_main(["--repo", str(REPO), "series", "check", "--json"]) == 0
    touched = json.loads(capsys.readouterr().out)["files"]
    assert touched == load_series(REPO).touched_paths()
    key = base_key(*nox_module.mypy_base_inputs(touched))
    found, line = lookup([REPO / "ci" / "mypy-base-errors"], key)
    assert found is not None, line
    assert found.files == touched
    assert all(isinstance(e, MypyError) for e in found.mypy_errors())
