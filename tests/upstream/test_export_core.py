"""`vllm-overlay export` of the core series: each core patch is its own
bundle against the pinned vLLM (not the connector stack), proven by the
`vllm-overlay removable` report, its tests ported to vLLM's connector unit
tests; without that report, or with one that does not prove it, nothing is
written."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.upstream.repos import REPO, MakeRepo, write_tree
from tests.upstream.test_export import _report, _ruff, _series, _write_tests
from vllm_overlay.checkout import Checkout
from vllm_overlay.gate.removable import (
    REMOVABLE_REPORT,
    CoreRow,
    RemovableReport,
    Verdict,
    encode_removable,
)
from vllm_overlay.series.core_series import load_core_series
from vllm_overlay.series.diff import apply_file_patch
from vllm_overlay.series.patch_series import load_series
from vllm_overlay.tree.materialize import BaseSource
from vllm_overlay.tree.target import installed_vllm
from vllm_overlay.upstream.export import (
    ExportError,
    core_test_path,
    export,
    load_context,
)

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
CORE_TEST = "tests/patches/core/test_c001_sync_load_not_zeroed.py"
PORTED = "tests/v1/kv_connector/unit/test_sync_load_not_zeroed.py"


@pytest.fixture
def core_repo(make_repo: MakeRepo, base_texts: dict[str, str]) -> Path:
    """The export tests' throwaway checkout plus the real core series and
    its test (with the builders it imports)."""
    root = make_repo(_series(base_texts))
    _write_tests(root)
    _report(root)
    shutil.copytree(REPO / "patches" / "core", root / "patches" / "core")
    shutil.copytree(REPO / "tests/patches/core", root / "tests/patches/core")
    for rel in (
        "tests/patches/builders.py",
        "tests/patches/vllm_unit_utils.py",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, root / rel)
    return root


def _removable(root: Path, *, with_: str = "passed") -> None:
    core = load_core_series(root)
    fix = core.patches[0]
    rows = [
        CoreRow(p.name, t, "failed", with_)  # type: ignore[arg-type]
        for p in core.patches
        for t in p.header.tests
    ]
    verdict = Verdict("0010-w.patch", fix.name, True, "4 of 4 named tests ...")
    report = RemovableReport(
        load_series(root).series_id,
        core.series_id,
        "0.34.0",
        rows,
        [verdict],
        "2026-12-03T12:00:00Z",
    )
    path = root / ".nox-reports" / REMOVABLE_REPORT
    path.write_bytes(encode_removable(report))


def _export(root: Path, tmp_path: Path, base: dict[str, str], *names: str):
    pin = Checkout(root).pin
    core = {p: (installed_vllm().parent / p).read_text() for p in pin.core_files}
    scheduler = core[SCHEDULER]
    site = write_tree(tmp_path / "site", {**base, **core})
    ctx = load_context(
        Checkout(root), BaseSource(tree=site), ruff=_ruff(), run_tests=False
    )
    return export(ctx, list(names), root / "dist" / "upstream"), scheduler


def test_the_core_patch_is_its_own_bundle_against_the_pinned_vllm(
    core_repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    _removable(core_repo)
    written, scheduler = _export(core_repo, tmp_path, base_texts, "c001")
    fix = load_core_series(core_repo).patches[0]
    out = core_repo / "dist" / "upstream" / fix.slug
    assert sorted(p.relative_to(out).as_posix() for p in written) == sorted(
        [f"{fix.slug}.patch", "PR.md", "checks.log"]
    )
    # git itself applies the mail to the pinned scheduler alone.
    git = tmp_path / "git"
    (git / SCHEDULER).parent.mkdir(parents=True)
    (git / SCHEDULER).write_text(scheduler)
    env = {"HOME": str(git), "PATH": "/usr/bin:/bin", "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(["git", "-C", str(git), *args], check=True, env=env)
    mail = out / f"{fix.slug}.patch"
    subprocess.run(
        ["git", "-C", str(git), "am", "--keep-non-patch", str(mail)],
        check=True,
        env=env,
        capture_output=True,
    )
    [fp] = fix.files
    assert (git / SCHEDULER).read_text() == apply_file_patch(scheduler, fp).text
    ported = (git / PORTED).read_text()
    assert "from .utils import create_scheduler" in ported
    assert "tests.patches" not in ported and "def make_vllm_config" in ported
    body = (out / "PR.md").read_text()
    assert "| `test_sync_load_blocks_are_not_zeroed[full]` | failed | passed |" in body
    assert "0010 removable with core patch c001: yes" in body
    log = (out / "checks.log").read_text()
    assert "[ok] applies to the pinned vLLM's core files" in log
    assert "[FAIL]" not in log


def test_the_whole_export_writes_the_core_bundle_too(
    core_repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    _removable(core_repo)
    written, _ = _export(core_repo, tmp_path, base_texts)
    dirs = sorted({p.parent.name for p in written})
    assert dirs == [
        "0001-port-offsets",
        "0002-stable-offsets",
        *(p.slug for p in load_core_series(core_repo).patches),
    ]


def test_no_removable_report_no_export(
    core_repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    with pytest.raises(ExportError, match=r"removable\.json: cannot read"):
        _export(core_repo, tmp_path, base_texts, "c001")
    assert not (core_repo / "dist").exists()


def test_a_core_patch_its_report_does_not_prove_stops_the_export(
    core_repo: Path, tmp_path: Path, base_texts: dict[str, str]
) -> None:
    _removable(core_repo, with_="failed")
    with pytest.raises(ExportError, match="failed without it, failed with it"):
        _export(core_repo, tmp_path, base_texts, "c001")
    assert not (core_repo / "dist").exists()


def test_core_tests_port_to_the_connector_unit_tests() -> None:
    assert core_test_path(REPO / CORE_TEST) == PORTED
