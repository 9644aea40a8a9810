"""Patch 0002's model of the bug, checked against the pinned base itself.

The base's wrong prompt lengths must be exactly the ones the mechanism of
seed 001 predicts (``predicted_wrong_on_base``). The sweep runs
the base MoRIIO files in a separate interpreter, so this file is ours only:
`vllm-overlay export` ports the patch's own tests, not this one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest

from tests.patches.builders import (
    ALL_SWEEP_CASES,
    MAX_PROMPT_TOKENS,
    SWEPT_TOKENS,
    UPSTREAM_WRONG_LENGTHS,
    Case,
    SweepResult,
    encode_request,
    predicted,
)
from vllm_overlay.warm import python_command

REPO = Path(__file__).resolve().parents[2]


def _materialize_base(out: Path) -> Path:
    """The pinned base MoRIIO files, recovered from the installed vLLM."""
    from vllm_overlay.series.patch_series import load_series
    from vllm_overlay.series.pin import PIN_FILE, load_pin
    from vllm_overlay.tree.materialize import base_from_target, materialize
    from vllm_overlay.tree.target import detect_target, installed_vllm

    pin = load_pin(REPO / PIN_FILE)
    series = load_series(REPO)
    bases = base_from_target(detect_target(installed_vllm()), pin, series)
    written = materialize(bases, series, out, overlay=False)
    [connector] = [p for p in written if p.name == "moriio_connector.py"]
    return connector.parent


def sweep_base(
    cases: Sequence[Case],
    model_dir: Path,
    work: Path,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> dict[str, list[int]]:
    """Sweep ``cases`` against the pinned base in a separate interpreter,
    every prompt length to ``max_prompt_tokens``."""
    moriio_dir = _materialize_base(work / "base")
    env = dict(os.environ)  # the CPU environment's platform switch included
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # Redirect the MoRIIO package to the base files before anything imports it.
    code = (
        "import sys; from pathlib import Path; "
        "from vllm_overlay.tree.variant import use_moriio_dir; "
        "use_moriio_dir(Path(sys.argv[1])); "
        "from tests.patches.builders import run_sweep_request; "
        "print(run_sweep_request(Path(sys.argv[2]), sys.argv[3]))"
    )
    proc = subprocess.run(
        [
            *python_command(env),  # warm in the suite: the package is not loaded
            "-c",
            code,
            str(moriio_dir),
            str(model_dir),
            encode_request(cases, max_prompt_tokens),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    last_line = proc.stdout.strip().splitlines()[-1]
    return msgspec.json.decode(last_line, type=SweepResult).wrong


@pytest.mark.slow
def test_base_wrong_lengths_match_the_mechanism(
    llama_model_dir: Path, tmp_path: Path
) -> None:
    """The base's wrong prompt lengths are exactly those where one leg's table
    ends one block past the other's in a way the base's clip-then-align turns
    into a shift (``predicted_wrong_on_base``): our model of the bug holds."""
    wrong = sweep_base(ALL_SWEEP_CASES, llama_model_dir, tmp_path, SWEPT_TOKENS)
    lengths = range(1, SWEPT_TOKENS + 1)
    for case in ALL_SWEEP_CASES:
        expected = predicted(case, lengths)
        assert expected, f"{case.name}: the sweep would not discriminate"
        observed = wrong[case.name]
        assert observed == expected, (
            f"{case.name}: only observed {sorted(set(observed) - set(expected))[:8]}, "
            f"only predicted {sorted(set(expected) - set(observed))[:8]}"
        )
    assert set(UPSTREAM_WRONG_LENGTHS) <= set(wrong["b64-w128-d9"])
