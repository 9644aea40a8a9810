"""Mixed pairs: each leg of a pair on its own connector build, the two
builds loaded in one process under the package's own names
(``simulate/builds.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_overlay.simulate.builds import BuildPair, builds_of, parse_pairs
from vllm_overlay.simulate.procs import pair_dirs
from vllm_overlay.tree.variant import MORIIO_FILES, build_variant_dir

REPO = Path(__file__).resolve().parents[2]


def test_variant_names_pairs_and_groups():
    names = [p.name for p in parse_pairs("all")]
    assert names == ["base", "overlay", "base->overlay", "overlay->base"]
    assert [p.name for p in parse_pairs("both")] == ["base", "overlay"]
    assert [p.name for p in parse_pairs("mixed,base->overlay")] == [
        "base->overlay",
        "overlay->base",
    ]
    pair = BuildPair.parse("base->overlay")
    assert (pair.prefill, pair.decode, pair.mixed) == ("base", "overlay", True)
    assert pair.build_of("kv_producer") == "base"
    assert pair.build_of("kv_consumer") == "overlay"
    assert BuildPair.parse("overlay") == BuildPair("overlay", "overlay")
    assert builds_of(parse_pairs("overlay->base")) == ["base", "overlay"]


@pytest.mark.parametrize("bad", ["foo", "base->", "->overlay", "base->foo", ","])
def test_a_bad_variant_is_a_value_error(bad):
    with pytest.raises(ValueError):
        parse_pairs(bad)


def test_a_pair_gets_the_directories_of_its_builds():
    dirs = {"base": Path("/b"), "overlay": Path("/o")}
    assert pair_dirs("base->overlay", dirs) == dirs
    assert pair_dirs("overlay", dirs) == {"overlay": Path("/o")}


def test_the_simulate_command_refuses_an_unknown_pair():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_overlay.cli", "simulate", "--variant", "x->y"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --variant 'x->y': unknown build 'x' in 'x->y'; a pair is base, "
        "overlay, base->overlay or overlay->base (or both, mixed, all)"
    ]


_CHILD = """
import sys
from pathlib import Path
from vllm_overlay.simulate.builds import (
    CONSUMER, PRODUCER, BuildPair, load_pair, module_of,
)
from vllm_overlay.simulate.drive import Pair
from vllm_overlay.simulate.layouts import expand

load_pair(BuildPair("a", "b"), {"a": Path(sys.argv[1]), "b": Path(sys.argv[2])})
pair = Pair(expand(["llama"])[0], max_model_len=256, port=47600)
p = module_of(pair.p.scheduler.connector)["SIMULATOR_SENTINEL"]
d = module_of(pair.d.scheduler.connector)["SIMULATOR_SENTINEL"]
case = pair.run_case(40, 0.0)
print("legs", p, d, case.error, case.wrong)
"""


def test_a_mixed_pair_runs_each_legs_own_build(tmp_path):
    """Two builds that differ by a sentinel: the prefiller's connector is
    build a's, the decoder's build b's, in one process, and a case runs."""
    dirs = []
    for name in ("a", "b"):
        dest = build_variant_dir(tmp_path / name / "moriio", None)
        connector = dest / MORIIO_FILES[0]
        connector.write_text(
            connector.read_text() + f"\nSIMULATOR_SENTINEL = {name!r}\n"
        )
        dirs.append(str(dest))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD), *dirs],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "legs a b None False"
