"""Execute a plan: pull, start everything, wait for health while watching
every container, always tear down.

Commands run locally or over ssh exactly as the plan spells them; every one
has a timeout, and a command that hangs or cannot run is a `LaunchError`
(one line in the report), never a traceback. Teardown (logs collected,
containers removed, processes terminated) runs on normal exit, on any
exception and on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, TracebackType

import msgspec

from vllm_overlay.e2e.plan import Plan, Step, on_host
from vllm_overlay.e2e.secret import all_values, scrub
from vllm_overlay.errors import OverlayError

STOP_GRACE_S = 15.0
LAST_LINES = 40
# Consecutive failures to ask a host about its containers (ssh down) before
# the run stops.
INSPECT_RETRIES = 3


class LaunchError(OverlayError):
    """A step of the run failed; everything started has been torn down."""


class HealthTimeout(LaunchError):
    """An endpoint did not answer within its timeout."""


class ContainerExited(LaunchError):
    """A container (or process) the run depends on is no longer running."""


class ContainerState(msgspec.Struct, forbid_unknown_fields=True):
    """What the report says about a container that stopped."""

    what: str
    where: str
    status: str  # docker's State.Status, "missing", or "process"
    exit_code: int
    oom_killed: bool = False
    last_lines: list[str] = msgspec.field(default_factory=list)

    def describe(self) -> str:
        oom = ", OOM-killed" if self.oom_killed else ""
        return f"{self.what} @ {self.where} {self.status} (exit {self.exit_code}{oom})"


class Endpoints(msgspec.Struct, forbid_unknown_fields=True):
    """Where the harness sends requests, once everything is up."""

    front: str  # P/D through the front end
    direct: str  # the first prefill server, for reference answers
    prefill: list[str]
    decode: list[str]


def probe(url: str, timeout_s: float) -> tuple[int, str]:
    """One GET: (HTTP status, short body or error); status 0 when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read(200).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(200).decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(getattr(e, "reason", e))


def probe_tcp(address: str, timeout_s: float) -> tuple[int, str]:
    """(200, "") when ``host:port`` accepts a connection, else (0, why)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout_s):
            return 200, ""
    except OSError as e:
        return 0, str(e)


def wait_healthy(
    url: str,
    timeout_s: float,
    poll_s: float,
    alive: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    check: Callable[[str, float], tuple[int, str]] = probe,
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
        status, body = check(url, min(poll_s, remaining))
        if status == 200:
            return clock() - start
        last = f"HTTP {status}: {body.strip()[:120]}" if status else body
        if alive is not None:
            alive()
        sleep(min(poll_s, max(deadline - clock(), 0)))


Check = Callable[[str, float], tuple[int, str]]


def wait_all_healthy(
    targets: Sequence[tuple[str, Check]],
    timeout_s: float,
    poll_s: float,
    alive: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, float]:
    """Poll every ``(url, check)`` at once until each answers 200; return
    the seconds each waited. A round probes every endpoint still waited
    for, in parallel, then calls ``alive``: N servers loading for T
    seconds take T, not N x T. HealthTimeout names every one that never
    answered."""
    start = clock()
    deadline = start + timeout_s
    waited: dict[str, float] = {}
    last = {url: "no answer yet" for url, _ in targets}
    checks = dict(targets)
    with ThreadPoolExecutor(max(len(targets), 1)) as pool:
        while len(waited) < len(checks):
            remaining = deadline - clock()
            if remaining <= 0:
                late = [u for u in checks if u not in waited]
                raise HealthTimeout(
                    f"not healthy after {timeout_s:g}s: "
                    + "; ".join(f"{u} ({last[u]})" for u in late)
                )
            pending = [u for u in checks if u not in waited]
            t = min(poll_s, remaining)
            answers = list(pool.map(lambda u, t=t: checks[u](u, t), pending))
            now = clock()
            for url, (status, body) in zip(pending, answers, strict=True):
                if status == 200:
                    waited[url] = now - start
                else:
                    last[url] = (
                        f"HTTP {status}: {body.strip()[:120]}" if status else body
                    )
            if len(waited) == len(checks):
                break
            if alive is not None:
                alive()
            sleep(min(poll_s, max(deadline - clock(), 0)))
    return waited


def resolve_executable(name: str) -> str:
    """``name`` on PATH, else next to this interpreter (a venv's bin/)."""
    if os.sep in name:
        return name
    found = shutil.which(name)
    if found is not None:
        return found
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    raise LaunchError(f"{name}: not found on PATH nor in {beside.parent}")


def run_command(
    argv: list[str], timeout_s: float, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """``argv`` with a timeout (and ``stdin`` written to it); a missing
    program or a timeout is a LaunchError."""
    try:
        return subprocess.run(
            argv, input=stdin, capture_output=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"`{' '.join(argv)[:200]}` did not finish in {timeout_s:g}s"
        ) from None
    except OSError as e:
        raise LaunchError(f"{argv[0]}: cannot run: {e.strerror or e}") from None


def run_streaming(
    argv: list[str], timeout_s: float, say: Callable[[str], None], prefix: str
) -> tuple[int, str]:
    """Run ``argv``, passing every output line to ``say`` as it comes (a
    pull's progress); stop it after ``timeout_s``. Returns (exit code, last
    line); a timeout is a LaunchError."""
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        raise LaunchError(f"{argv[0]}: cannot run: {e.strerror or e}") from None
    last = [""]

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                last[0] = line
                say(f"{prefix} {line}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=5)
        raise LaunchError(
            f"{prefix} `{' '.join(argv)[:200]}` did not finish in {timeout_s:g}s"
            f" (last output: {last[0][:200] or 'none'})"
        ) from None
    reader.join(timeout=5)
    return code, last[0]


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


@contextmanager
def signals_deferred(say: Callable[[str], None]) -> Iterator[list[int]]:
    """Within the block (the teardown), SIGINT and SIGTERM interrupt
    nothing: nox sends SIGTERM 0.3 s after Ctrl-C's SIGINT, and a second
    Ctrl-C is common; either would leave containers or a Slurm job behind.
    Each one received is said once and listed."""
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        say(f"e2e: signal {signum} during teardown: finishing the teardown first")

    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {
        sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def last_lines(text: str, n: int = LAST_LINES) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-n:]


class ClosedOnExit:
    """Leaving the ``with`` block, whatever happened, runs ``close``; an
    exception is said first, with what closing does about it."""

    say: Callable[[str], None]
    closing = "tearing down"
    # Ctrl-C or SIGTERM ended the run: remove what runs before anything
    # slower (log collection).
    interrupted = False

    def close(self) -> None:
        raise NotImplementedError

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.say(f"e2e: {exc_type.__name__}: {exc}; {self.closing}")
            self.interrupted = issubclass(exc_type, Terminated | KeyboardInterrupt)
        with signals_deferred(self.say):
            self.close()


class Launcher(ClosedOnExit):
    """Runs a plan's setup; on leaving the ``with`` block, whatever happened,
    collects logs into ``log_dir`` and runs the teardown.

    Between health polls (and whenever the runner asks) every started
    container is inspected: one that is no longer running stops the run at
    once with its exit code and last log lines (`stopped`).

    ``secrets`` holds the secret env values of each container, by step
    (`servers.leg_secrets`): a start step reads them on its stdin; collected
    logs show them as ``***``."""

    def __init__(
        self,
        plan: Plan,
        log_dir: Path,
        endpoints: Endpoints,
        poll_s: float = 5.0,
        command_s: float = 120.0,
        say: Callable[[str], None] = print,
        secrets: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.plan = plan
        self.secrets = secrets or {}
        self.log_dir = log_dir
        self.endpoints = endpoints
        self.poll_s = poll_s
        self.command_s = command_s
        self.say = say
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.started: list[Step] = []
        self.waited: dict[str, float] = {}
        self.stopped: list[ContainerState] = []
        self._inspect_failures = 0
        self._closed = False

    def __enter__(self) -> Launcher:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def setup(self) -> Endpoints:
        """Every setup step in order; the servers' health waits (a run of
        consecutive waits before the front end's) at once."""
        steps = self.plan.setup
        i = 0
        while i < len(steps):
            j = i
            while (
                j < len(steps)
                and steps[j].action == "wait"
                and steps[j].what != "router"
            ):
                j += 1
            if j - i > 1:
                self.wait_all(steps[i:j])
                i = j
            else:
                self.run(steps[i])
                i += 1
        return self.endpoints

    def wait_all(self, steps: list[Step]) -> None:
        for step in steps:
            self.say(f"[{step.what} @ {step.where}] {step.describe()}")
        targets = [(s.url, probe_tcp if s.probe == "tcp" else probe) for s in steps]
        self.waited.update(
            wait_all_healthy(
                targets,
                max(s.timeout_s for s in steps),
                self.poll_s,
                alive=self.check_alive,
            )  # fmt: skip
        )

    def run(self, step: Step) -> None:
        self.say(f"[{step.what} @ {step.where}] {step.describe()}")
        if step.action == "wait":
            check = probe_tcp if step.probe == "tcp" else probe
            self.waited[step.url] = wait_healthy(
                step.url, step.timeout_s, self.poll_s, alive=self.check_alive,
                check=check,
            )  # fmt: skip
            return
        if step.action == "spawn":
            argv = [resolve_executable(step.argv[0]), *step.argv[1:]]
            with (self.log_dir / f"{step.what}.log").open("wb") as log:
                try:
                    self.processes[step.what] = subprocess.Popen(
                        argv, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                except OSError as e:
                    raise LaunchError(f"{argv[0]}: cannot run: {e}") from None
            self.started.append(step)
            return
        if step.action == "pull":
            code, last = run_streaming(
                step.argv, step.timeout_s, self.say, f"[pull @ {step.where}]"
            )
            if code != 0:
                raise LaunchError(f"pull @ {step.where}: exit {code}: {last[:300]}")
            return
        result = run_command(step.argv, self.command_s, self.stdin(step))
        if step.action == "collect":
            text = (result.stdout + result.stderr).decode(errors="replace")
            (self.log_dir / f"{step.what}.log").write_text(
                scrub(text, all_values(self.secrets))
            )
        if step.action == "start":
            self.started.append(step)
        if result.returncode != 0 and step.must_succeed:
            err = result.stderr.decode(errors="replace").strip()[-500:]
            raise LaunchError(
                f"{step.what} @ {step.where}: exit {result.returncode}: {err}"
            )

    def stdin(self, step: Step) -> bytes | None:
        """The secret values ``step`` reads, one a line; None: it reads none."""
        if not step.secret_env:
            return None
        values = self.secrets.get(step.what, {})
        missing = [n for n in step.secret_env if n not in values]
        if missing:
            raise LaunchError(f"{step.what}: no value for {', '.join(missing)}")
        return "".join(f"{values[n]}\n" for n in step.secret_env).encode()

    def inspect(self, step: Step) -> ContainerState | None:
        """None while ``step``'s container runs; its state once it stopped."""
        engine = self.plan.engine
        fmt = "{{.State.Status}} {{.State.ExitCode}} {{.State.OOMKilled}}"
        argv = on_host(step.reach, [engine, "inspect", "--format", fmt, step.container])
        result = run_command(argv, self.command_s)
        if result.returncode == 255 and step.reach.ssh:
            self._inspect_failures += 1
            if self._inspect_failures >= INSPECT_RETRIES:
                err = result.stderr.decode(errors="replace").strip()[-300:]
                raise LaunchError(f"cannot reach {step.where} over ssh: {err}")
            return None
        self._inspect_failures = 0
        words = result.stdout.decode(errors="replace").split()
        if result.returncode == 0 and words and words[0] in ("running", "created"):
            return None
        if result.returncode != 0 or len(words) < 3:
            status, code, oom = "missing", -1, False
        else:
            status, code, oom = words[0], int(words[1]), words[2] == "true"
        logs = run_command(
            on_host(
                step.reach, [engine, "logs", "--tail", str(LAST_LINES), step.container]
            ),
            self.command_s,
        )
        text = scrub(
            (logs.stdout + logs.stderr).decode(errors="replace"),
            all_values(self.secrets),
        )
        return ContainerState(
            step.what, step.where, status, code, oom, last_lines(text)
        )

    def check_alive(self) -> None:
        """Raise ContainerExited if a started container or process stopped."""
        for what, proc in self.processes.items():
            code = proc.poll()
            if code is not None:
                log = self.log_dir / f"{what}.log"
                text = log.read_text(errors="replace") if log.is_file() else ""
                state = ContainerState(
                    what, "local", "process", code, False, last_lines(text)
                )
                self.stopped.append(state)
                raise ContainerExited(self.stop_message(state))
        for step in self.started:
            if step.action != "start":
                continue
            stopped = self.inspect(step)
            if stopped is not None:
                self.stopped.append(stopped)
                raise ContainerExited(self.stop_message(stopped))

    @staticmethod
    def stop_message(state: ContainerState) -> str:
        tail = " | ".join(state.last_lines[-3:]) or "no log output"
        return f"{state.describe()}; last lines: {tail[:600]}"

    def stop_process(self, what: str) -> None:
        proc = self.processes.pop(what, None)
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
        started = {s.what for s in self.started}
        steps = [*self.plan.collect, *self.plan.teardown]
        if self.interrupted:
            # Interrupted: every container is removed first; the logs of the
            # removed containers are gone, the processes' log files stay.
            steps = list(self.plan.teardown)
            self.say(
                "e2e: interrupted: removing every container first; container "
                "logs are not collected"
            )
        for step in steps:
            if step.action == "collect" and step.what not in started:
                continue
            try:
                if step.action == "stop" and not step.argv:
                    self.say(f"[{step.what} @ {step.where}] {step.describe()}")
                    self.stop_process(step.what)
                else:
                    self.run(step)
            except (OSError, subprocess.SubprocessError, LaunchError) as e:
                self.say(f"e2e: teardown step failed: {step.describe()}: {e}")
        for what in list(self.processes):
            self.stop_process(what)
