"""A rolling upgrade in WRITE, both legs vLLM's real schedulers (the
simulator's mixed pairs, deepseek-v4-pro-BLNHC: a 128-token window, block
64, which vLLM's pinned MoRIIO serves in WRITE). Each leg's build sends or
takes the write_done notify: a base decoder takes this build's (its new
key unknown to it), and where this build's writer refuses the pages
(write_failed) it recomputes the request; this build's decoder reports a
base prefiller's unstated write_done failed and recomputes the request."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

REPO = Path(__file__).resolve().parents[2]
LENGTHS = (191, 255, 600)
VARIANTS = {"overlay->base": 48100, "base->overlay": 48300}

# vLLM is imported once (the scheduler and the connector base, never the
# MoRIIO package); each direction then runs in a process forked from there, which
# loads both builds' MoRIIO modules as a mixed pair must: once, first.
_CHILD = """
import json, os, sys
from pathlib import Path

import torch
import vllm.distributed.kv_transfer.kv_connector.v1.base
import vllm.v1.core.sched.scheduler

from vllm_overlay.simulate.builds import BuildPair, load_pair
from vllm_overlay.simulate.drive import Pair
from vllm_overlay.simulate.layouts import expand
from vllm_overlay.tree.variant import MODULE_PACKAGE

assert MODULE_PACKAGE not in sys.modules, "imported before the builds load"


def run(variant, port):
    prefill, decode = variant.split("->")
    load_pair(
        BuildPair(prefill, decode),
        {"overlay": Path(sys.argv[1]), "base": Path(sys.argv[2])},
    )
    layout = expand(["deepseek-v4-pro-BLNHC"])[0]
    pair = Pair(layout, max_model_len=1024, port=port, mode="write")
    out = {}
    for n in map(int, sys.argv[4].split(",")):
        case = pair.run_case(n, 0.0)
        out[n] = [case.wrong, case.error, case.fallback]
    return out


for variant, port in json.loads(sys.argv[3]).items():
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            print(json.dumps({variant: run(variant, port)}), flush=True)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"{variant}: exited {os.waitstatus_to_exitcode(status)}")
"""


@pytest.fixture(scope="module")
def results(
    tmp_path_factory: pytest.TempPathFactory, base_texts: dict[str, str]
) -> dict[str, dict[int, list]]:
    overlay = Path(moriio_connector.__file__).parent
    base = tmp_path_factory.mktemp("base") / "moriio"
    base.mkdir(parents=True)
    for path, text in base_texts.items():
        (base / Path(path).name).write_text(text)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_CHILD),
            str(overlay),
            str(base),
            json.dumps(VARIANTS),
            ",".join(map(str, LENGTHS)),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found: dict[str, dict[int, list]] = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            for variant, cases in json.loads(line).items():
                found[variant] = {int(k): v for k, v in cases.items()}
    assert sorted(found) == sorted(VARIANTS), out.stdout[-3000:]
    return found


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixed_write_reads_no_wrong_kv_and_counts_failed_receives(
    results: dict[str, dict[int, list]], variant: str
) -> None:
    """No wrong KV and no crash either way. A base decoder recomputes where
    this build's writer refuses its null window start (N - 127 = 0 mod 64:
    191, 255) and takes the write elsewhere; this build's decoder
    recomputes every request a base prefiller wrote."""
    result = results[variant]
    assert all(not wrong and error is None for wrong, error, _ in result.values())
    fallbacks = {n for n, (_, _, fallback) in result.items() if fallback}
    if variant == "overlay->base":
        assert fallbacks == {191, 255}
    else:
        assert fallbacks == set(LENGTHS)
