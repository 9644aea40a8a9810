"""The pair config's validation and the reviewed dry-run plan."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.conftest import EXAMPLE, FIXTURES
from vllm_overlay.cli import main
from vllm_overlay.e2e.config import ConfigError, decode_config, load_config
from vllm_overlay.e2e.plan import ROCM_FLAGS, build_plan


def test_dry_run_matches_the_reviewed_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["e2e", "--config", str(EXAMPLE), "--dry-run"]) == 0
    expected = (FIXTURES / "mi350x-pair.plan.txt").read_text()
    assert capsys.readouterr().out == expected


def test_plan_order_and_flags() -> None:
    plan = build_plan(load_config(EXAMPLE))
    actions = [(s.role, s.action) for s in plan.setup]
    starts = [r for r, a in actions if a == "start"]
    assert starts == ["router", "prefill", "decode"]
    waits = [r for r, a in actions if a == "wait"]
    assert waits == ["prefill", "decode", "router"]
    assert actions.index(("router", "start")) < actions.index(("prefill", "wait"))
    for s in plan.setup:
        if s.action == "start" and s.role != "router":
            joined = " ".join(s.argv)
            assert " ".join(ROCM_FLAGS) in joined
            assert "--shm-size 64g" in joined
    assert [s.role for s in plan.teardown] == ["decode", "prefill", "router"]
    decode_start = next(s for s in plan.setup if s.role == "decode" and s.inner)
    assert decode_start.argv[:3] == ["ssh", "-o", "BatchMode=yes"]


BAD = {
    "missing section": ("[decode]", "[nodecode]", "unknown field `nodecode`"),
    "bad port": (
        "http_port = 8200",
        "http_port = 70000",
        "<= 65535 - at `$.decode.http_port`",
    ),
    "bad type": ("tp = 8\nhandshake", 'tp = "eight"\nhandshake', "Expected `int`"),
    "dcp": ("tp = 8\nhandshake", "tp = 8\ndcp = 3\nhandshake", "multiple of dcp"),
    "backend": ('backend = "rdma"', 'backend = "tcp"', "must be 'rdma' or 'xgmi'"),
    "not toml": ("[router]", "[router", "not valid TOML"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_is_one_clear_error(case: str, tmp_path: Path) -> None:
    old, new, message = BAD[case]
    text = EXAMPLE.read_text()
    assert old in text
    path = tmp_path / "pair.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def test_bad_config_exits_non_zero_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pair.toml"
    path.write_text(EXAMPLE.read_text().replace("http_port = 8200", "http_port = 0"))
    assert main(["e2e", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ">= 1 - at `$.decode.http_port`" in err


def test_same_endpoint_for_both_legs_is_refused() -> None:
    text = EXAMPLE.read_text().replace('address = "10.0.0.2"', 'address = "10.0.0.1"')
    text = text.replace("http_port = 8200", "http_port = 8100")
    with pytest.raises(ConfigError, match="share one address and http_port"):
        decode_config(text)
