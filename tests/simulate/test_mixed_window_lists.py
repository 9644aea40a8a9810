"""A rolling upgrade's half: this build's READ prefiller with vLLM's pinned
MoRIIO as the decoder (it cannot change), both legs vLLM's real schedulers
(the simulator's mixed pair, gemma: window 512, block 16). At N = 1 mod 16
the base decoder's window READ lands on the pages of the same positions
(patch 0018's window lists laid out for the whole prompt)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

REPO = Path(__file__).resolve().parents[2]


_CHILD = """
import json, sys
from pathlib import Path
from vllm_overlay.simulate.builds import BuildPair, load_pair
from vllm_overlay.simulate.drive import Pair
from vllm_overlay.simulate.layouts import expand

load_pair(
    BuildPair("overlay", "base"),
    {"overlay": Path(sys.argv[1]), "base": Path(sys.argv[2])},
)
pair = Pair(expand(["gemma"])[0], max_model_len=2048, port=int(sys.argv[3]))
out = {}
for n in map(int, sys.argv[4].split(",")):
    case = pair.run_case(n, 0.0)
    out[n] = [case.wrong, case.error, case.fallback]
print(json.dumps(out))
"""


LENGTHS = (529, 545)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, base_texts: dict[str, str]):
    """Every length's (wrong, error, fallback), one child process (one
    vLLM import, one scheduler pair) running them in turn."""
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
            "47829",
            ",".join(map(str, LENGTHS)),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n", LENGTHS)
def test_base_decoder_reads_the_right_window(results: dict[str, list], n: int) -> None:
    """vLLM's pinned MoRIIO as the decoder (it cannot change), this build as
    the prefiller, both legs vLLM's real schedulers (the simulator's mixed
    pair, gemma: window 512, block 16): at N = 1 mod 16 the base decoder's
    window READ lands on the pages of the same positions."""
    assert results[str(n)] == [False, None, False]
