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

_CHILD = """
import json, sys
from pathlib import Path
from vllm_overlay.simulate.builds import BuildPair, load_pair
from vllm_overlay.simulate.drive import Pair
from vllm_overlay.simulate.layouts import expand

prefill, decode = sys.argv[1].split("->")
load_pair(
    BuildPair(prefill, decode),
    {"overlay": Path(sys.argv[2]), "base": Path(sys.argv[3])},
)
layout = expand(["deepseek-v4-pro-BLNHC"])[0]
pair = Pair(layout, max_model_len=1024, port=int(sys.argv[4]), mode="write")
out = {}
for n in map(int, sys.argv[5].split(",")):
    case = pair.run_case(n, 0.0)
    out[n] = [case.wrong, case.error, case.fallback]
print(json.dumps(out))
"""


def _run(tmp_path: Path, base_texts: dict[str, str], variant: str, port: int):
    overlay = Path(moriio_connector.__file__).parent
    base = tmp_path / "base" / "moriio"
    base.mkdir(parents=True)
    for path, text in base_texts.items():
        (base / Path(path).name).write_text(text)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_CHILD),
            variant,
            str(overlay),
            str(base),
            str(port),
            ",".join(map(str, LENGTHS)),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {int(k): v for k, v in json.loads(out.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("variant", ["overlay->base", "base->overlay"])
def test_mixed_write_reads_no_wrong_kv_and_counts_failed_receives(
    tmp_path: Path, base_texts: dict[str, str], variant: str
) -> None:
    """No wrong KV and no crash either way. A base decoder recomputes where
    this build's writer refuses its null window start (N - 127 = 0 mod 64:
    191, 255) and takes the write elsewhere; this build's decoder
    recomputes every request a base prefiller wrote."""
    port = 48100 if variant == "overlay->base" else 48300
    result = _run(tmp_path, base_texts, variant, port)
    assert all(not wrong and error is None for wrong, error, _ in result.values())
    fallbacks = {n for n, (_, _, fallback) in result.items() if fallback}
    if variant == "overlay->base":
        assert fallbacks == {191, 255}
    else:
        assert fallbacks == set(LENGTHS)
