"""``simulate --core``: both legs on vLLM with the core series applied, the
families' rings stating their group size where vLLM's spec has the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.repo import REPO
from vllm_overlay.checkout import Checkout
from vllm_overlay.series.core_series import load_core_series
from vllm_overlay.simulate.core import CORE_ENV, core_tree
from vllm_overlay.tree.materialize import BaseSource

INTERFACE = "vllm/v1/kv_cache_interface.py"
# The layouts with a ring, and the group size their model code states.
RINGS = {
    "glm": 16,
    "deepseek-v4.1": 2,
    "glm5next-BLNHC": 16,
    "qwen4-exp-mtp": 16,
    "step5-mtp": 8,
}

PROBE = """
import json, sys
from vllm_overlay.simulate.core import load_core_from_env
loaded = load_core_from_env()
from vllm_overlay.simulate.layouts import all_layouts
from vllm.v1.kv_cache_interface import CircularBufferSpec
out = {}
for name in json.loads(sys.argv[1]):
    specs = all_layouts()[name].build_specs()
    out[name] = sorted({
        str(getattr(s, "compress_ratio", None))
        for s in specs.values() if isinstance(s, CircularBufferSpec)
    })
print(json.dumps({"loaded": loaded, "rings": out}))
"""


def _ring_group_sizes(env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(RINGS))],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=REPO,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_core_tree_holds_the_whole_core_series_while_the_sweep_runs() -> None:
    checkout = Checkout(REPO)
    keys = [p.name[:4] for p in load_core_series(REPO).patches]
    with core_tree(BaseSource(), checkout) as applied:
        root = Path(os.environ[CORE_ENV])
        assert applied == f"{keys[0]}..{keys[-1]}"
        assert "compress_ratio: int | None = None" in (root / INTERFACE).read_text()
        assert not (root / "vllm/distributed").exists()
    assert CORE_ENV not in os.environ
    assert not root.exists()


def test_rings_state_their_group_size_only_on_a_core_vllm() -> None:
    env = {k: v for k, v in os.environ.items() if k != CORE_ENV}
    assert _ring_group_sizes(env) == {
        "loaded": False,
        "rings": {name: ["None"] for name in RINGS},
    }
    with core_tree(BaseSource(), Checkout(REPO)) as _:
        env[CORE_ENV] = os.environ[CORE_ENV]
        assert _ring_group_sizes(env) == {
            "loaded": True,
            "rings": {name: [str(size)] for name, size in RINGS.items()},
        }
