"""Execute a plan: start everything, wait for health, always tear down.

Commands run locally or over ssh exactly as the plan spells them. Teardown
(logs collected, containers removed, processes terminated) runs on normal
exit, on any exception and on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, TracebackType

from vllm_overlay.e2e.plan import Plan, Step
from vllm_overlay.errors import OverlayError

COMMAND_TIMEOUT_S = 600.0
STOP_GRACE_S = 15.0


class LaunchError(OverlayError):
    """A step of the plan failed; everything started has been torn down."""


class HealthTimeout(LaunchError):
    """An endpoint did not answer 200 within its timeout."""


def probe(url: str, timeout_s: float) -> tuple[int, str]:
    """One GET: (HTTP status, short body or error); status 0 when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read(200).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(200).decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(getattr(e, "reason", e))


def wait_healthy(
    url: str,
    timeout_s: float,
    poll_s: float,
    alive: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Poll ``url`` until it answers 200; return the seconds waited.

    ``alive`` is called between polls and raises when something the wait
    depends on has died. Raises HealthTimeout after ``timeout_s``.
    """
    start = clock()
    deadline = start + timeout_s
    last = "no answer yet"
    while True:
        remaining = deadline - clock()
        if remaining <= 0:
            raise HealthTimeout(f"{url}: not healthy after {timeout_s:g}s ({last})")
        status, body = probe(url, min(poll_s, remaining))
        if status == 200:
            return clock() - start
        last = f"HTTP {status}: {body.strip()[:120]}" if status else body
        if alive is not None:
            alive()
        sleep(min(poll_s, max(deadline - clock(), 0)))


def resolve_executable(name: str) -> str:
    """``name`` on PATH, else next to this interpreter (a venv's bin/)."""
    found = shutil.which(name)
    if found is not None:
        return found
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    raise LaunchError(f"{name}: not found on PATH nor in {beside.parent}")


class Terminated(Exception):
    """SIGTERM, turned into an exception so teardown runs."""


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises (like Ctrl-C raises KeyboardInterrupt)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Launcher:
    """Runs a plan's setup; on leaving the ``with`` block, whatever happened,
    collects logs into ``log_dir`` and runs the teardown."""

    def __init__(
        self,
        plan: Plan,
        log_dir: Path,
        poll_s: float = 5.0,
        say: Callable[[str], None] = print,
    ) -> None:
        self.plan = plan
        self.log_dir = log_dir
        self.poll_s = poll_s
        self.say = say
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.started: list[Step] = []
        self.waited: dict[str, float] = {}
        self._closed = False

    def __enter__(self) -> Launcher:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.say(f"e2e: {exc_type.__name__}: {exc}; tearing down")
        self.close()

    def setup(self) -> None:
        for step in self.plan.setup:
            self.run(step)

    def run(self, step: Step) -> None:
        self.say(f"[{step.role} @ {step.where}] {step.describe()}")
        if step.action == "wait":
            self.waited[step.url] = wait_healthy(
                step.url, step.timeout_s, self.poll_s, alive=self.check_processes
            )
            return
        if step.action == "spawn":
            argv = [resolve_executable(step.argv[0]), *step.argv[1:]]
            with (self.log_dir / f"{step.role}.log").open("wb") as log:
                self.processes[step.role] = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            self.started.append(step)
            return
        result = subprocess.run(
            step.argv, capture_output=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
        if step.action == "collect":
            (self.log_dir / f"{step.role}.log").write_bytes(
                result.stdout + result.stderr
            )
        if step.action == "start":
            self.started.append(step)
        if result.returncode != 0 and step.must_succeed:
            err = result.stderr.decode(errors="replace").strip()[-500:]
            raise LaunchError(
                f"{step.role} @ {step.where}: exit {result.returncode}: {err}"
            )

    def check_processes(self) -> None:
        for role, proc in self.processes.items():
            code = proc.poll()
            if code is not None:
                raise LaunchError(
                    f"{role} process exited with {code}; see {self.log_dir}/{role}.log"
                )

    def stop_process(self, role: str) -> None:
        proc = self.processes.pop(role, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_GRACE_S)

    def close(self) -> None:
        """Collect logs and tear down; idempotent, never raises for a step."""
        if self._closed:
            return
        self._closed = True
        started_roles = {s.role for s in self.started}
        for step in [*self.plan.collect, *self.plan.teardown]:
            if step.role not in started_roles and step.action == "collect":
                continue
            try:
                if step.action == "stop" and not step.argv:
                    self.say(f"[{step.role} @ {step.where}] {step.describe()}")
                    self.stop_process(step.role)
                else:
                    self.run(step)
            except (OSError, subprocess.SubprocessError, LaunchError) as e:
                self.say(f"e2e: teardown step failed: {step.describe()}: {e}")
        for role in list(self.processes):
            self.stop_process(role)
