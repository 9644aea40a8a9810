"""How a byte-level sweep makes its plan: zygotes on ports no other zygote
of the sweep draws from, and a bad argument refused before anything runs
(how the plan is handed out: ``test_bytes_dispatch.py``)."""

from __future__ import annotations

import pytest

from vllm_overlay.simulate.bytes.ports import PORT_RANGE, port_ranges


@pytest.mark.parametrize("count", [1, 2, 4, 6])
def test_each_zygote_draws_ports_from_its_own_range(count):
    ranges = port_ranges(count)
    assert len(ranges) == count
    lo, hi = PORT_RANGE
    edges = [edge for r in ranges for edge in r]
    assert edges == sorted(edges) and lo <= edges[0] and edges[-1] <= hi
    assert all(b - a >= 100 for a, b in ranges), "room for a rank's port block"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--modes", "bogus"], "--modes: unknown ['bogus']"),
        (["--kv-layouts", "NHD"], "--kv-layouts: unknown ['NHD']"),
        (["--kv-layouts", ","], "--kv-layouts: unknown []"),
        (["--tp", "3-x"], "--tp '3-x': want PREFILL-DECODE pairs"),
        (["--tp", "0-1"], "--tp '0-1': want PREFILL-DECODE pairs"),
        (["--layouts", "llama/dcp2", "--tp", "1-1"], "TP 2->2 only"),
    ],
)
def test_a_bad_argument_is_one_line_before_anything_starts(
    capsys, tmp_path, monkeypatch, args, says
):
    """Refused while the plan is made: exit 2, one line naming the option,
    no simulator process started and no report written."""
    from vllm_overlay.cli import main
    from vllm_overlay.simulate.bytes import cli

    def started(*_args, **_kwargs):
        raise AssertionError("a simulator process started")

    monkeypatch.setattr(cli, "run_bytes_sweep", started)
    report = tmp_path / "r.json"
    argv = ["simulate-bytes", "--variant", "overlay", "--report", str(report)]
    assert main([*argv, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err
    assert not report.exists()
