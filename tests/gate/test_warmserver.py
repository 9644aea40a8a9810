"""`vllm_overlay.gate.warmserver` with `vllm_overlay.warm` in front: a child
forked from the server's loaded modules behaves as ``python ARGS`` would
(arguments, working directory, environment, streams, exit status,
signals), and starts cold, as ``python ARGS``, when a fresh start could
have loaded something else."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from vllm_overlay.gate.warmserver import parse, shadowed
from vllm_overlay.warm import PARENT_ENV, WARM_ENV, Cold, python_command

ROOT = Path(__file__).resolve().parents[2]

# The server: this module loaded, then serving until its stdin closes.
SERVER = """
import os, sys
from pathlib import Path
import loaded.here
from vllm_overlay.gate import warmserver
pid, path = warmserver.start(Path(sys.argv[1]), sys.argv[2])
print(path, flush=True)
sys.stdin.read()
os.kill(pid, 15)
os.waitpid(pid, 0)
"""
# What a child shows of itself; loaded.here says which process loaded it.
SHOW = """
import os, sys
import loaded.here
print(sys.argv[1:], os.getcwd() == sys.argv[1], sys.path[0] == "")
print(os.environ["VLLM_OVERLAY_TOUCH_TEST"], sys.stdin.read())
print("fresh" if loaded.here.BY == os.getpid() else "warm")
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


LOADED_HERE = """import os
BY = os.getpid()
if __name__ == "__main__":
    print("main", BY == os.getpid())
"""


class Served:
    def __init__(self, root: Path, log: Path, path: str, pid: int) -> None:
        self.root, self.log, self.path, self.pid = root, log, path, pid

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": str(self.root / "lib"),
            WARM_ENV: self.path,
            "VLLM_OVERLAY_TOUCH_TEST": "late",  # read late (the evidence hook's)
            **extra,
        }

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.is_file() else []


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "loaded").mkdir()
    (lib / "loaded" / "__init__.py").write_text("")
    (lib / "loaded" / "here.py").write_text(LOADED_HERE)
    log = tmp_path / "warm.log"
    env = {**os.environ, "PYTHONPATH": f"{lib}{os.pathsep}{ROOT}"}
    env.pop(WARM_ENV, None)
    sock = tmp_path / "sock"
    sock.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(sock), str(log)],
        env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    path = proc.stdout.readline().strip()
    try:
        yield Served(tmp_path, log, path, proc.pid)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def _run(
    cmd: list[str], env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=env, cwd=cwd, input="in", capture_output=True, text=True, timeout=60
    )


def test_a_child_runs_forked_from_the_loaded_modules_as_python_would(
    served: Served,
) -> None:
    env = served.env()
    args = ["-c", SHOW, str(served.root), "b"]
    warm = _run([*python_command(env), *args], env, served.root)
    cold = _run([sys.executable, *args], {**env, WARM_ENV: ""}, served.root)
    assert python_command(env)[1:] == ["-I", "-m", "vllm_overlay.warm", "--"]
    assert (warm.returncode, cold.returncode) == (3, 3)
    assert warm.stderr == cold.stderr == "to stderr\n"
    shown = f"['{served.root}', 'b'] True True\nlate in\n"
    assert (warm.stdout, cold.stdout) == (shown + "warm\n", shown + "fresh\n")
    assert served.lines() == ["warm\t-c"]


def test_a_module_runs_as_main_with_its_arguments(served: Served) -> None:
    env = served.env()
    cmd = [*python_command(env), "-P", "-m", "json.tool", "--sort-keys"]
    done = subprocess.run(
        cmd, env=env, cwd=served.root, input='{"b": 1, "a": 2}',
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == '{\n    "a": 2,\n    "b": 1\n}\n'
    assert served.lines() == ["warm\tjson.tool"]


def test_a_module_the_server_loaded_runs_as_main_afresh(served: Served) -> None:
    env = served.env()
    done = _run([*python_command(env), "-m", "loaded.here"], env, served.root)
    assert (done.returncode, done.stdout, done.stderr) == (0, "main True\n", "")
    assert served.lines() == ["warm\tloaded.here"]


def test_an_environment_read_on_start_up_starts_the_child_cold(served: Served) -> None:
    env = served.env(OMP_NUM_THREADS="7")
    done = _run([*python_command(env), "-c", SHOW, str(served.root)], env, served.root)
    assert done.returncode == 3
    assert done.stdout.endswith("fresh\n")
    assert served.lines() == ["cold\tenvironment differs in OMP_NUM_THREADS"]


def test_a_module_ahead_on_the_path_starts_the_child_cold(served: Served) -> None:
    other = served.root / "other"
    other.mkdir()
    (other / "loaded").mkdir()
    (other / "loaded" / "__init__.py").write_text("")
    (other / "loaded" / "here.py").write_text("import os\nBY = os.getpid()\n")
    env = served.env(PYTHONPATH=f"{other}{os.pathsep}{served.root / 'lib'}")
    done = _run([*python_command(env), "-c", SHOW, str(served.root)], env, served.root)
    assert done.stdout.endswith("fresh\n")
    assert served.lines() == [f"cold\t{other / 'loaded'} would shadow loaded"]


def _gone(pid: int, within: float = 10.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


WAIT = """
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["terminate", "kill"])
def test_a_signal_to_the_caller_ends_the_child(served: Served, how: str) -> None:
    env = served.env()
    pid_file = served.root / "pid"
    proc = subprocess.Popen([*python_command(env), "-c", WAIT, str(pid_file)], env=env)
    while not pid_file.is_file() or not pid_file.read_text():
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert child != proc.pid
    getattr(proc, how)()
    expected = -signal.SIGTERM if how == "terminate" else -signal.SIGKILL
    assert proc.wait(timeout=30) == expected
    assert _gone(child)


# A caller that starts the child bound to it (PARENT_ENV), then waits.
CALLER = """
import os, subprocess, sys
env = {**os.environ, "VLLM_OVERLAY_PARENT_PID": str(os.getpid())}
cmd = [*sys.argv[3:], "-c", sys.argv[1], sys.argv[2]]
subprocess.Popen(cmd, env=env)
sys.stdin.read()
"""
BOUND = """
import os, signal, sys, time
out = sys.argv[1]
bound = os.environ["VLLM_OVERLAY_PARENT_PID"] == str(os.getppid())
def ended(*_):
    open(out, "a").write("ended\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, ended)
open(out, "w").write(f"bound {bound}\\n")
time.sleep(60)
"""


def test_a_child_bound_to_its_caller_ends_with_it(served: Served) -> None:
    result = served.root / "result"
    env = served.env()
    assert PARENT_ENV == "VLLM_OVERLAY_PARENT_PID"
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, BOUND, str(result), *python_command(env)],
        env=env, stdin=subprocess.PIPE,
    )  # fmt: skip
    while not result.is_file() or not result.read_text():
        time.sleep(0.05)
    caller.kill()
    caller.wait(timeout=30)
    end = time.monotonic() + 20
    while "ended" not in result.read_text() and time.monotonic() < end:
        time.sleep(0.05)
    assert result.read_text() == "bound True\nended\n"
    assert served.lines() == ["warm\t-c"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["-P", "-m", "pkg.mod", "x"], ("pkg.mod", "", True, ["x"])),
        (["-c", "pass", "y"], ("", "pass", False, ["y"])),
        (["-u", "-c", "pass"], "arguments other than [-P] -m/-c: -u -c"),
        (["script.py"], "arguments other than [-P] -m/-c: script.py"),
    ],
)
def test_only_module_and_code_children_are_forked(args, said) -> None:  # noqa: ANN001
    parsed = parse(args)
    if isinstance(said, str):
        assert parsed == said
    else:
        assert not isinstance(parsed, str)
        assert (parsed.module, parsed.code, parsed.safe_path, parsed.rest) == said


def test_a_module_of_the_same_place_is_no_shadow(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    loaded = {"pkg": str(tmp_path / "pkg" / "__init__.py")}
    assert shadowed([str(tmp_path)], loaded) == ""
    assert shadowed([str(tmp_path)], {"pkg": "/elsewhere/pkg/__init__.py"}) == (
        f"{tmp_path / 'pkg'} would shadow pkg"
    )


def test_an_unreadable_request_is_answered_cold_in_one_line(served: Served) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(served.path)
        socket.send_fds(conn, [b'{"args": 1}\n'], [0, 1, 2])
        reply = conn.makefile("rb").readline()
    assert msgspec.json.decode(reply, type=Cold).why.startswith("unreadable request: ")
    assert served.lines() == [
        "cold\tunreadable request: Expected `array`, got `int` - at `$.args`"
    ]


def test_without_a_server_the_child_is_python_itself(served: Served) -> None:
    env = served.env(**{WARM_ENV: str(served.root / "no-such-socket")})
    done = _run([*python_command(env), "-c", SHOW, str(served.root)], env, served.root)
    assert (done.returncode, done.stdout.splitlines()[-1]) == (3, "fresh")
    assert python_command({}) == [sys.executable]
    assert served.lines() == []


def test_no_arguments_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, "-I", "-m", "vllm_overlay.warm", "--"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "usage: python -m vllm_overlay.warm -- PYTHON-ARGUMENTS\n"
