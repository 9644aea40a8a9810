"""`vllm-overlay image verify`, the checks the image build runs from inside
the image, here run on this environment's vLLM and on throwaway trees."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tests.image.conftest import REPO
from vllm_overlay import cpuplatform
from vllm_overlay.cli import main
from vllm_overlay.image.verify import (
    Verification,
    check_banner,
    check_connector,
    check_overlay,
    check_router,
    check_version,
    router_pin,
    same_release,
    verify_install,
)
from vllm_overlay.series.patch_series import load_series
from vllm_overlay.series.pin import Pin
from vllm_overlay.tree.apply import apply_series
from vllm_overlay.tree.status import tree_status
from vllm_overlay.tree.target import detect_target, installed_vllm

SERIES = load_series(REPO)


def installed_is_overlaid(pin: Pin) -> bool:
    report, _ = tree_status(detect_target(installed_vllm()), pin, SERIES)
    return report.state == "overlaid"


def test_overlay_check_on_a_base_and_an_overlaid_tree(site: Path, pin: Pin) -> None:
    base = check_overlay(site / "vllm", pin, SERIES)
    assert not base.ok and base.detail.startswith("status base")
    apply_series(detect_target(site / "vllm"), pin, SERIES)
    done = check_overlay(site / "vllm", pin, SERIES)
    assert done.ok, done.detail
    assert (
        done.detail
        == f"series {SERIES.series_id} overlaid on {len(pin.files)} pinned files"
    )


def test_overlay_check_names_the_series_of_another_checkout(
    site: Path, pin: Pin, one_patch_repo: Path
) -> None:
    apply_series(detect_target(site / "vllm"), pin, load_series(one_patch_repo))
    check = check_overlay(site / "vllm", pin, SERIES)
    assert not check.ok  # overlaid, but not by this series


def test_version_check(pin: Pin) -> None:
    assert check_version(pin).ok
    other = msgspec.structs.replace(
        pin, vllm=msgspec.structs.replace(pin.vllm, version="0.32.0")
    )
    check = check_version(other)
    assert not check.ok
    assert check.detail == (
        f"vllm.__version__ {pin.vllm.version}, distribution {pin.vllm.version}; "
        "the pin is 0.32.0"
    )


@pytest.mark.parametrize(
    ("found", "ok"),
    [
        ("0.33.0", True),
        ("0.33.0+rocm721", True),
        ("0.33.0rc1", False),
        ("0.33.0.post1", False),
        ("0.33.1", False),
        ("0.33.0.dev5+g4ba787ec9", False),
    ],
)
def test_a_local_build_label_is_the_same_release(found: str, ok: bool) -> None:
    assert same_release(found, "0.33.0") is ok


def test_connector_check_imports_from_the_tree_it_names(site: Path, pin: Pin) -> None:
    check = check_connector(installed_vllm(), pin)
    assert check.ok, check.detail
    assert check.detail.startswith("MoRIIOConnector from ")
    # The module this Python imports is not the one in a copied tree.
    elsewhere = check_connector(site / "vllm", pin)
    assert not elsewhere.ok and "imported from" in elsewhere.detail


def test_banner_check_through_vllms_plugin_loader(pin: Pin) -> None:
    check = check_banner(installed_vllm(), SERIES)
    assert check.ok == installed_is_overlaid(pin), check.detail
    if check.ok:
        assert check.detail.startswith("moriio_overlay_banner logs: ")
        assert f"series {SERIES.series_id} " in check.detail


def test_router_check(monkeypatch: pytest.MonkeyPatch) -> None:
    assert router_pin(REPO) == "0.1.17"
    assert check_router("0.1.17").ok
    wrong = check_router("9.9.9")
    assert not wrong.ok and wrong.detail.startswith("vllm-router 0.1.17 (pinned 9.9.9)")


def test_router_check_needs_what_the_router_requires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The Dockerfile installs the router --no-deps: what it requires must
    # already be in the base (vLLM's own dependencies).
    import importlib.metadata

    real = importlib.metadata.requires

    def requires(dist: str) -> list[str] | None:
        if dist != "vllm-router":
            return real(dist)
        return [
            "msgspec>=0.18",
            'no-such-package-xyz>=1; python_version >= "3"',
            'also-not-installed; extra == "dev"',
        ]

    monkeypatch.setattr(importlib.metadata, "requires", requires)
    check = check_router("0.1.17")
    assert not check.ok
    assert check.detail == (
        "vllm-router 0.1.17 requires no-such-package-xyz, not installed"
    )


def test_every_check_runs_and_the_verdict_is_their_and(pin: Pin) -> None:
    v = verify_install(REPO, pin, SERIES)
    names = [c.name for c in v.checks]
    assert names == [
        "overlay",
        "vllm-version",
        "connector-import",
        "banner-plugin",
        "vllm-router",
    ]
    assert v.ok == all(c.ok for c in v.checks)
    assert v.ok == installed_is_overlaid(pin)


def _verify_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = cpuplatform.cpu_environ()
    return subprocess.run(
        [sys.executable, "-m", "vllm_overlay.cli", "--repo", str(REPO),
         "image", "verify", *args],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip


def test_cli_json_and_exit_status(pin: Pin) -> None:
    out = _verify_cli("--json")
    # Under --json stdout is the one JSON object and nothing else.
    v = msgspec.json.decode(out.stdout, type=Verification)
    assert out.returncode == (0 if v.ok else 1)
    assert v.series_id == SERIES.series_id
    assert json.loads(out.stdout)["checks"][0]["name"] == "overlay"


def test_cli_text_ends_with_the_verdict(
    pin: Pin, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process (the --json test above runs the CLI's own): the checks
    # import what the other tests here imported already.
    code = main(["--repo", str(REPO), "image", "verify"])
    verdict = "verify: ok" if code == 0 else "verify: FAILED"
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith(verdict)


def test_verify_without_the_series_requires_the_base_files(
    site: Path, pin: Pin
) -> None:
    from vllm_overlay.image.verify import check_base

    ok = check_base(site / "vllm", pin, SERIES)
    assert ok.ok and ok.detail == (
        f"no series: {len(pin.files)} pinned files are the base's"
    )
    apply_series(detect_target(site / "vllm"), pin, SERIES)
    overlaid = check_base(site / "vllm", pin, SERIES)
    assert not overlaid.ok and overlaid.detail.startswith("status overlaid")


def test_mori_must_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_overlay.image.rdma import check_mori

    monkeypatch.delitem(sys.modules, "mori", raising=False)
    missing = check_mori()
    assert not missing.ok
    assert missing.detail == "import mori: ModuleNotFoundError: No module named 'mori'"
    (tmp_path / "mori").mkdir()
    (tmp_path / "mori" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = check_mori()
    assert found.ok and found.detail == f"mori from {tmp_path / 'mori'}"
    monkeypatch.delitem(sys.modules, "mori", raising=False)


def test_an_ibverbs_provider_needs_its_driver_entry_and_library(
    tmp_path: Path,
) -> None:
    from vllm_overlay.image.rdma import check_ibverbs

    drivers = tmp_path / "etc" / "libibverbs.d"
    drivers.mkdir(parents=True)
    (drivers / "ionic.driver").write_text("driver ionic\n")
    none = check_ibverbs(tmp_path)
    assert not none.ok and none.detail.startswith("no libibverbs provider")
    libs = tmp_path / "usr" / "lib" / "x86_64-linux-gnu" / "libibverbs"
    libs.mkdir(parents=True)
    (libs / "libionic-rdmav34.so").write_text("")
    (drivers / "mlx5.driver").write_text("driver mlx5\n")  # no library: not one
    found = check_ibverbs(tmp_path)
    assert found.ok and found.detail == "providers: ionic"


def test_the_toy_proxy_must_start_and_listen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The E2E tests' stand-in for vLLM's toy proxy (same command line).
    from tests.e2e.ports import free_port
    from vllm_overlay.image.rdma import check_toy_proxy

    monkeypatch.setenv("STANDIN_DISCOVERY", f"127.0.0.1:{free_port()}")
    proxy = REPO / "tests" / "e2e" / "frontend.py"
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    ok = check_toy_proxy(str(proxy))
    assert ok.ok, ok.detail
    assert ok.detail.startswith(f"{proxy} listens on port ")
    broken = tmp_path / "proxy.py"
    broken.write_text("import no_such_module_here\n")
    bad = check_toy_proxy(str(broken))
    assert not bad.ok
    assert bad.detail == (
        "exited 1: ModuleNotFoundError: No module named 'no_such_module_here'"
    )
    assert check_toy_proxy(str(tmp_path / "nope.py")).detail.endswith("no such file")


def test_verify_with_rdma_adds_its_three_checks(site: Path, pin: Pin) -> None:
    v = verify_install(REPO, pin, SERIES, site / "vllm", rdma=True, toy_proxy="/x")
    assert [c.name for c in v.checks][-3:] == ["mori", "ibverbs-provider", "toy-proxy"]
    plain = verify_install(REPO, pin, SERIES, site / "vllm")
    assert "mori" not in [c.name for c in plain.checks]
