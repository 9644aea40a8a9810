"""`vllm-overlay gate`: the unit-base run order, the overlay back on after
a failed or interrupted base run, each step's environment, and `--plan`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vllm_overlay.cli import main
from vllm_overlay.gate.phases import PHASES_FILE
from vllm_overlay.gate.sequence import (
    OLD_WHEEL_ENV,
    PARENT_ENV,
    Dirs,
    Run,
    Step,
    prepare,
    run_step,
    run_steps,
    step_env,
    steps,
)


def _commands(todo: list[Step]) -> list[str]:
    return [" ".join(s.args[:2]) if s.args[0] == "apply" else s.args[0] for s in todo]


def test_the_steps_run_in_the_gates_order(tmp_path: Path) -> None:
    todo = steps(Dirs(tmp_path), "", "OUT")
    assert _commands(todo) == [
        "apply",
        "levels",
        "removable",
        "simulate-bytes",
        "suite",
        "apply --revert",
        "suite",
        "apply",
        "revert-red",
        "export",
    ]
    assert [s.phase for s in todo if s.phase] == [
        "levels",
        "removable",
        "bytes",
        "overlay",
        "base",
        "revert-red",
        "export",
    ]
    # Only the re-apply after the base run runs after a failure.
    assert [i for i, s in enumerate(todo) if s.always] == [7]
    base = todo[6]
    assert base.args[:3] == ("suite", "--variant", "base")
    # Beside the overlay run: the steps of materialized trees, never the
    # base run: they end before the base goes on. The export reads the
    # reports of revert-red and removable: it comes last.
    assert [s.phase for s in todo if s.beside] == ["levels", "removable", "bytes"]
    assert [_commands([s])[0] for s in todo if s.joins] == [
        "apply --revert",
        "revert-red",
    ]


def test_pytest_arguments_go_to_the_overlay_and_base_runs(tmp_path: Path) -> None:
    todo = steps(Dirs(tmp_path), "-k 'a and b'", "OUT")
    given = [s.args[0] for s in todo if any(a.endswith("-k 'a and b'") for a in s.args)]
    assert given == ["suite", "suite"]


def _record(codes: dict[str, int], interrupt: str = "") -> tuple[list[str], Run]:
    ran: list[str] = []

    def run(step: Step, env: dict[str, str], out: list[str] | None) -> int:
        name = " ".join(step.args[:3])
        ran.append(name)
        if name == interrupt:
            raise KeyboardInterrupt
        return codes.get(name, 0)

    return ran, run


def _beside(dirs: Dirs) -> list[str]:
    """The tree steps as `_record` names them."""
    return [
        f"levels --out {dirs.levels}",
        f"removable --out {dirs.removable}",
        "simulate-bytes --layouts gemma,dsv4,kimi,glm",
    ]


def test_a_failed_base_run_still_puts_the_overlay_back(tmp_path: Path) -> None:
    dirs = Dirs(tmp_path)
    todo = steps(dirs, "", "OUT")
    ran, run = _record({"suite --variant base": 3})
    done = run_steps(todo, {}, run, lambda line: None, dirs.phases, "r1")
    overlay = "suite --out " + str(dirs.overlay)
    assert ran[0] == "apply" and sorted(ran[1:5]) == sorted([*_beside(dirs), overlay])
    assert ran[5:] == ["apply --revert", "suite --variant base", "apply"]
    assert done.failed is todo[6] and done.status == 3
    phases = json.loads((tmp_path / ".nox-reports" / PHASES_FILE).read_text())
    assert phases["run"] == "r1"
    assert set(phases["phases"]) == {"levels", "removable", "bytes"} | {
        "overlay",
        "base",
    }


def test_the_tree_steps_run_beside_the_overlay_run_and_end_before_the_base(
    tmp_path: Path,
) -> None:
    """Levels, removable, export and the byte sweep share the cores with the
    overlay run (it is still running when they start) and have all ended
    before `apply --revert` puts the base on."""
    dirs = Dirs(tmp_path)
    todo = steps(dirs, "", "OUT")
    overlay = "suite --out " + str(dirs.overlay)
    beside = _beside(dirs)
    started = {name: threading.Event() for name in [*beside, overlay]}
    ended: set[str] = set()
    buffered: list[bool] = []
    seen: dict[str, object] = {}

    def run(step: Step, env: dict[str, str], out: list[str] | None) -> int:
        name = " ".join(step.args[:3])
        if name in started:
            started[name].set()
        if name == overlay:
            # The overlay run is still going when the last tree step starts.
            seen["beside"] = started[beside[-1]].wait(10)
            seen["buffered"] = out
        if name in beside:
            buffered.append(out is not None)
            started[overlay].wait(10)
            ended.add(name)
        if name == "apply --revert":
            seen["ended before the base"] = set(ended)
        return 0

    done = run_steps(todo, {}, run, lambda line: None, dirs.phases, "r")
    assert done.failed is None and done.ran == len(todo)
    assert seen["beside"] is True and seen["buffered"] is None
    assert buffered == [True] * 3  # their output is printed whole
    assert seen["ended before the base"] == set(beside)


def test_a_beside_steps_output_is_printed_whole_when_it_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = Dirs(tmp_path)
    todo = steps(dirs, "", "OUT")
    overlay = "suite --out " + str(dirs.overlay)
    # The beside thread prints a step's block before it starts the next.
    levels_printed = threading.Event()

    def run(step: Step, env: dict[str, str], out: list[str] | None) -> int:
        name = " ".join(step.args[:3])
        if name == overlay:
            levels_printed.wait(10)
            print("overlay line")
        if step.args[0] == "removable":
            levels_printed.set()
        if out is not None:
            out.append(f"{step.args[0]} line 1\n{step.args[0]} line 2\n")
        return 0

    run_steps(todo, {}, run, print, dirs.phases, "r")
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("running each patch's named tests on the stack levels in between")
    assert lines[at + 1 : at + 3] == ["levels line 1", "levels line 2"]
    assert lines.index("levels line 2") < lines.index("overlay line")
    at = lines.index("a small byte sweep with the overlay: its verdict gates too")
    assert lines[at + 1 : at + 3] == ["simulate-bytes line 1", "simulate-bytes line 2"]
    # The export's line once it passed, after revert-red.
    assert lines[-1] == "unit-base: every patch exports (ruff, git am in stack order)"


def test_a_failed_beside_step_stops_the_gate_before_the_base_run(
    tmp_path: Path,
) -> None:
    dirs = Dirs(tmp_path)
    todo = steps(dirs, "", "OUT")
    ran, run = _record({"levels --out " + str(dirs.levels): 1})
    done = run_steps(todo, {}, run, lambda line: None, dirs.phases, "r")
    assert done.failed is todo[1] and done.status == 1
    overlay = "suite --out " + str(dirs.overlay)
    # The overlay run had started; no tree step after levels, no base run;
    # the overlay is put back all the same.
    assert sorted(ran[1:3]) == sorted(["levels --out " + str(dirs.levels), overlay])
    assert ran[0] == "apply" and ran[3:] == ["apply"]


def test_a_beside_step_that_cannot_start_fails_the_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = Dirs(tmp_path)
    todo = steps(dirs, "", "OUT")

    def run(step: Step, env: dict[str, str], out: list[str] | None) -> int:
        if step.args[0] == "removable":
            raise OSError("no such interpreter")
        return 0

    done = run_steps(todo, {}, run, lambda line: None, dirs.phases, "r")
    assert done.failed is todo[2] and done.status == 1
    assert "removable --out" in capsys.readouterr().out


def test_an_interrupted_base_run_still_puts_the_overlay_back(tmp_path: Path) -> None:
    dirs = Dirs(tmp_path)
    ran, run = _record({}, interrupt="suite --variant base")
    with pytest.raises(KeyboardInterrupt):
        run_steps(steps(dirs, "", "OUT"), {}, run, lambda line: None, dirs.phases, "")
    assert ran[-2:] == ["suite --variant base", "apply"]


def test_each_step_gets_the_environment_it_had_under_the_noxfile() -> None:
    todo = {s.phase: s for s in steps(Dirs(Path("/r")), "", "OUT") if s.phase}
    env = {OLD_WHEEL_ENV: "old.whl", PARENT_ENV: "1", "VLLM_OVERLAY_WHEEL": "w"}
    for phase in ("overlay", "base"):
        assert step_env(todo[phase], env)[OLD_WHEEL_ENV] == "old.whl"
        assert step_env(todo[phase], env)["VLLM_OVERLAY_WHEEL"] == "w"
        assert PARENT_ENV not in step_env(todo[phase], env)
    for phase in ("levels", "removable", "export"):
        assert OLD_WHEEL_ENV not in step_env(todo[phase], env)
        assert step_env(todo[phase], env)["VLLM_OVERLAY_WHEEL"] == "w"
    for phase in ("revert-red", "bytes"):
        assert not {OLD_WHEEL_ENV, "VLLM_OVERLAY_WHEEL"} & set(
            step_env(todo[phase], env)
        )
    # `apply` reads the base from this Python's vLLM, as under the noxfile.
    assert "VLLM_OVERLAY_WHEEL" not in step_env(
        steps(Dirs(Path("/r")), "", "O")[0], env
    )
    # The byte sweep ends with its parent, the gate (this process), whatever
    # process the gate's own environment names.
    assert step_env(todo["bytes"], env)[PARENT_ENV] == str(os.getpid())
    assert step_env(todo["levels"], env)["VLLM_OVERLAY_CPU_PLATFORM"] == "1"


def test_the_byte_step_outlives_its_start_under_a_nested_parent() -> None:
    """The gate runs under nox, which names itself as the sweep's parent; the
    step the gate starts must still run (not exit 128 + SIGTERM at once)."""
    todo = {s.phase: s for s in steps(Dirs(Path("/r")), "", "OUT") if s.phase}
    env = step_env(todo["bytes"], {**os.environ, PARENT_ENV: str(os.getppid())})
    arm = (
        "import signal; from vllm_overlay.simulate.bytes.lifetime import "
        "die_with_parent_from_env as d; d(signal.SIGTERM); print('ran')"
    )
    done = subprocess.run(
        [sys.executable, "-c", arm], env=env, capture_output=True, text=True
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ran"), done.stderr


def test_prepare_keeps_the_last_times_and_removes_the_last_outputs(
    tmp_path: Path,
) -> None:
    dirs = Dirs(tmp_path)
    for d in (dirs.overlay, dirs.base, dirs.levels):
        d.mkdir(parents=True)
    (dirs.overlay / "times.json").write_text("{}")
    done = prepare(dirs)
    assert dirs.cached_times.read_text() == "{}"
    assert not any(d.exists() for d in (dirs.overlay, dirs.base, dirs.levels))
    assert len(done) == 4
    # The next run spreads the files by them too, after the checkout's.
    overlay = next(s for s in steps(dirs, "", "OUT") if s.phase == "overlay")
    times = [a for a in overlay.args if a.endswith(".json")]
    assert times == [str(tmp_path / "ci" / "suite-times.json"), str(dirs.cached_times)]


def test_plan_prints_the_steps_and_runs_nothing(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--repo", str(repo), "gate", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "[base] vllm-overlay suite --variant base" in out
    assert "vllm-overlay apply (also after a failure)" in out
    assert "level 1: " in out
    assert "[removable] vllm-overlay removable --out " in out
    assert out.rstrip().endswith("gate --plan: 10 steps, nothing run")


def test_gate_without_a_wheel_is_one_line_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("VLLM_OVERLAY_WHEEL", raising=False)
    repo = tmp_path / "repo"
    (repo / "patches").mkdir(parents=True)
    (repo / "pin.toml").write_text("")
    (repo / "patches" / "series").write_text("")
    (repo / ".nox-reports" / "levels").mkdir(parents=True)
    assert main(["--repo", str(repo), "gate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no pinned vLLM wheel" in err
    assert (repo / ".nox-reports" / "levels").is_dir()  # nothing removed


# A stand-in for the CLI a step runs: its CPU is a child's, which it waits for.
FAKE_CLI = """
import subprocess
import sys

BURN = "import time\\nwhile time.process_time() < 0.4:\\n    pass"
subprocess.run([sys.executable, "-c", BURN], check=True)
print("fake step", *sys.argv[1:])
sys.exit(int(sys.argv[1]))
"""


def test_each_phase_records_the_cpu_of_its_steps_process_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step's CPU seconds are those of its process and the children it
    waited for, apart from a step that runs beside it; a silent step's
    output is printed when it fails."""
    root = tmp_path / "checkout"
    (root / "vllm_overlay").mkdir(parents=True)
    (root / "vllm_overlay" / "__init__.py").write_text("")
    (root / "vllm_overlay" / "cli.py").write_text(FAKE_CLI)
    dirs = Dirs(tmp_path)
    todo = [
        Step(("0",), phase="levels", beside=True),
        Step(("0",), phase="overlay"),
        Step(("3",), phase="export", silent=True),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    done = run_steps(todo, env, run_step(root), lambda line: None, dirs.phases, "r")
    assert done.failed is todo[2] and done.status == 3
    cpu = json.loads(dirs.phases.read_text())["cpu"]
    assert set(cpu) == {"levels", "overlay", "export"}
    assert all(0.4 <= seconds < 5 for seconds in cpu.values()), cpu
    assert "fake step 3" in capsys.readouterr().out
