"""Mixed build pairs (``vllm_overlay.simulate.builds``) for the rolling-upgrade
tests, every pair in a process of its own, all forked from one that imported
vLLM once.

A mixed pair loads both builds' MoRIIO modules once, before anything imports
the package: ``python -m tests.simulate.mixed OVERLAY BASE`` imports torch,
the scheduler and the connector base (never the MoRIIO package), then reads
one ``Job`` per line on stdin and runs each in a forked process, one after
the other, writing one result line per job. ``MixedPairs`` (the session
fixture ``mixed_pairs``) drives it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import msgspec

from tests.repo import REPO
from vllm_overlay.warm import python_command

MARK = "mixed-result: "


class Job(msgspec.Struct, frozen=True):
    """One pair: ``pair`` "prefill->decode" builds, the layout and mode its
    legs run, and the prompt lengths it runs at a 0 % hit."""

    pair: str
    layout: str
    mode: str
    max_model_len: int
    port: int
    lengths: tuple[int, ...]


class Result(msgspec.Struct):
    cases: dict[int, tuple[bool, str | None, bool]] = {}
    error: str | None = None


def _run(job: Job, dirs: dict[str, Path]) -> Result:
    from vllm_overlay.simulate.builds import BuildPair, load_pair
    from vllm_overlay.simulate.drive import Pair
    from vllm_overlay.simulate.layouts import expand

    prefill, decode = job.pair.split("->")
    load_pair(BuildPair(prefill, decode), dirs)
    layout = expand([job.layout])[0]
    pair = Pair(layout, max_model_len=job.max_model_len, port=job.port, mode=job.mode)
    cases = {}
    for n in job.lengths:
        case = pair.run_case(n, 0.0)
        cases[n] = (case.wrong, case.error, case.fallback)
    return Result(cases)


def serve(overlay: Path, base: Path) -> int:
    import torch  # noqa: F401  (vLLM expects torch imported first)
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401

    from vllm_overlay.simulate import builds, drive, layouts  # noqa: F401
    from vllm_overlay.tree.variant import MODULE_PACKAGE

    if MODULE_PACKAGE in sys.modules:
        raise SystemExit(f"{MODULE_PACKAGE} imported before the builds load")
    dirs = {"overlay": overlay, "base": base}
    for line in sys.stdin:
        job = msgspec.json.decode(line, type=Job)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                result = _run(job, dirs)
            except BaseException:  # noqa: BLE001  (reported, the child ends)
                result = Result(error=traceback.format_exc()[-3000:])
            print(MARK + msgspec.json.encode(result).decode(), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status):
            print(MARK + msgspec.json.encode(Result(error="exited")).decode())
            sys.stdout.flush()
    return 0


class MixedPairs:
    """The serving process, started on the first job."""

    def __init__(self, overlay: Path, base: Path) -> None:
        self._args = [str(overlay), str(base)]
        self._proc: subprocess.Popen[str] | None = None
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed by close)

    def run(self, job: Job) -> dict[int, tuple[bool, str | None, bool]]:
        if self._proc is None:
            self._proc = subprocess.Popen(
                # Warm in the suite: the package is not loaded there.
                [*python_command(), "-m", "tests.simulate.mixed", *self._args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._err,
                text=True,
                cwd=REPO,
            )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(msgspec.json.encode(job).decode() + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith(MARK):
                result = msgspec.json.decode(line[len(MARK) :], type=Result)
                assert result.error is None, result.error
                return result.cases
        self._err.seek(0)
        raise AssertionError(f"the pair server ended: {self._err.read()[-3000:]}")

    def close(self) -> None:
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        self._err.close()


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1]), Path(sys.argv[2])))
