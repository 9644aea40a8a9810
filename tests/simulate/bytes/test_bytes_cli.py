"""``vllm-overlay simulate-bytes``: its own subcommand, its options checked
into a typed struct before anything starts; ``simulate --bytes`` runs it with
one deprecation line on stderr."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from vllm_overlay.command import UsageError
from vllm_overlay.simulate.bytes.cli import BytesOptions, options_from
from vllm_overlay.simulate.bytes.report import ConfigItem
from vllm_overlay.simulate.bytes.steps import TRANSPORT

SELECTION = ["--layouts", "llama", "--modes", "read", "--tp", "1-1,2-1"]


def _planned(monkeypatch, argv: list[str]) -> list[ConfigItem]:
    """The configurations a command line hands to the sweep (not run)."""
    from vllm_overlay.cli import main
    from vllm_overlay.simulate.bytes import cli

    planned: list[list[ConfigItem]] = []

    def capture(items, *_args, **_kwargs):
        planned.append(items)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "run_bytes_sweep", capture)
    with contextlib.suppress(SystemExit):
        main(argv)
    (items,) = planned
    return items


def test_simulate_bytes_is_a_subcommand(monkeypatch, capsys, tmp_path: Path) -> None:
    report = ["--report", str(tmp_path / "r.json"), "--variant", "overlay"]
    items = _planned(monkeypatch, ["simulate-bytes", *SELECTION, *report])
    assert {(i.layout, i.mode, i.p_tp, i.d_tp) for i in items} == {
        ("llama", "read", 1, 1),
        ("llama", "read", 2, 1),
    }
    assert "deprecated" not in capsys.readouterr().err


def test_simulate_dash_dash_bytes_runs_it_with_one_deprecation_line(
    monkeypatch, capsys, tmp_path: Path
) -> None:
    from vllm_overlay.simulate.cli import DEPRECATED_BYTES

    report = ["--report", str(tmp_path / "r.json"), "--variant", "overlay"]
    own = _planned(monkeypatch, ["simulate-bytes", *SELECTION, *report])
    capsys.readouterr()
    old = _planned(monkeypatch, ["simulate", "--bytes", *SELECTION, *report])
    err = capsys.readouterr().err
    assert old == own
    assert err.splitlines()[0] == DEPRECATED_BYTES
    assert "vllm-overlay simulate-bytes" in DEPRECATED_BYTES


def test_simulate_bytes_has_no_scheduler_only_options(capsys) -> None:
    from vllm_overlay.cli import main

    for option in ("--bytes", "--whole", "--update-readme"):
        assert main(["simulate-bytes", option]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: unrecognized arguments: {option} ")


def test_simulate_bytes_faults_names_its_own_faults(capsys) -> None:
    """``simulate-bytes --faults`` takes the transport's faults, not the
    scheduler simulator's refusal paths."""
    from vllm_overlay.cli import main

    assert main(["simulate-bytes", "--faults", "hook-raises"]) == 2
    err = capsys.readouterr().err
    assert "--faults: unknown ['hook-raises']" in err


def _args(*argv: str):
    from vllm_overlay.cli import build_parser

    return build_parser().parse_args(["simulate-bytes", *argv])


def test_options_are_a_typed_struct() -> None:
    opts = options_from(_args("--modes", "write", "--tp", "2-1,1", "--all-hits"))
    assert opts == BytesOptions(
        modes=("write",),
        kv_layouts=("LBNHC", "BLNHC"),
        tp_pairs=((2, 1), (1, 1)),
        all_hits=True,
    )
    assert options_from(_args()).tp_pairs is None


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--modes", "read,bogus"), "--modes: unknown ['bogus']"),
        (("--tp", "1-x"), "--tp '1-x': want PREFILL-DECODE pairs"),
        (("--kv-layouts", "NHD"), "--kv-layouts: unknown ['NHD']"),
    ],
)
def test_a_bad_option_is_one_line(argv: tuple[str, ...], says: str) -> None:
    with pytest.raises(UsageError) as exc:
        options_from(_args(*argv))
    assert str(exc.value).startswith(says) and "\n" not in str(exc.value)


def test_a_bad_option_fails_before_the_known_gaps_are_read(
    monkeypatch, capsys, tmp_path: Path
) -> None:
    """Checked up front: a bad --tp is the error even where the known-gaps
    file would fail too."""
    from vllm_overlay.cli import main
    from vllm_overlay.simulate import cli

    def gaps(_app):
        raise AssertionError("read the known gaps before checking --tp")

    monkeypatch.setattr(cli, "_gaps", gaps)
    argv = ["simulate-bytes", "--tp", "0-1", "--report", str(tmp_path / "r.json")]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("error: --tp '0-1'")


def test_bad_input_to_simulate_dash_dash_bytes_is_still_one_line(capsys) -> None:
    """The deprecation note comes once the arguments are good: an error
    stays the one line on stderr."""
    from vllm_overlay.cli import main

    assert main(["simulate", "--bytes", "--tp", "0-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --tp '0-1'"), err


@pytest.mark.parametrize("faults", ["abort", "drop,error", "late"])
def test_a_write_only_fault_without_write_is_one_line_before_anything_runs(
    monkeypatch, capsys, tmp_path: Path, faults: str
) -> None:
    """A WRITE-only fault named with READ alone would run nothing: an
    argument error (exit 2), not a verdict after a sweep."""
    from vllm_overlay.cli import main
    from vllm_overlay.simulate.bytes import cli

    def ran(*_args, **_kwargs):
        raise AssertionError("ran the sweep")

    monkeypatch.setattr(cli, "run_bytes_sweep", ran)
    report = tmp_path / "r.json"
    argv = ["simulate-bytes", "--faults", faults, "--modes", "read"]
    assert main([*argv, "--report", str(report)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --faults ") and "WRITE only" in err, err
    assert err.count("\n") == 1 and not report.exists()


def test_every_fault_with_read_alone_runs_the_read_faults(monkeypatch) -> None:
    argv = ["simulate-bytes", "--faults", "--modes", "read", "--layouts", "llama"]
    items = _planned(monkeypatch, argv)
    assert items and {i.mode for i in items} == {"read"}
    assert not {i.fault for i in items} & {f"{TRANSPORT}drop", f"{TRANSPORT}late"}
