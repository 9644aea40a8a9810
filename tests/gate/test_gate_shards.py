"""How `vllm-overlay suite` spreads the suite over pytest runs: what pytest
collects in a shard (conftest ignores honoured), the shards cut by recorded
seconds and handed to the cores as they free up, and the estimate for a
file with no record."""

from __future__ import annotations

import json
import os
import shutil
from math import ceil
from pathlib import Path

import msgspec
import pytest

from tests.repo import REPO
from vllm_overlay.cli import main
from vllm_overlay.gate.pytestargs import names_a_test, split_paths
from vllm_overlay.gate.shards import (
    CPU_TIMES,
    FILE_TIMES,
    SHARDS_PER_CORE,
    START,
    FileTimes,
    ShardError,
    Times,
    load_file_seconds,
    plan,
    preload_names,
    run_shards,
    targets,
    warm_summary,
    weigh,
)
from vllm_overlay.gate.shards import test_files as listed

PKG = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shards' pytest finds this checkout's plugins from any directory."""
    paths = [str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


def test_a_shard_collects_what_the_conftests_leave_in(
    tmp_path: Path, importable: None
) -> None:
    """A conftest's collect_ignore and collect_ignore_glob hold in a shard:
    the left-out files are listed (static) but never run, in either lane."""
    tests = tmp_path / "tests"
    _write(
        tests / "area" / "conftest.py",
        'collect_ignore = ["test_left_out.py"]\n'
        'collect_ignore_glob = ["test_glob_*.py"]\n',
    )
    fail = "def test_it():\n    raise AssertionError('collected')\n"
    _write(tests / "area" / "test_left_out.py", fail)
    _write(tests / "area" / "test_glob_out.py", fail)
    _write(tests / "area" / "test_kept.py", "def test_it():\n    pass\n")
    _write(tests / "other" / "test_b.py", "def test_it():\n    pass\n")
    files = listed(tmp_path, ["tests"])
    assert len(files) == 4
    weights = {f: 1.0 for f in files}
    shards = plan(tmp_path, files, 2, weights)
    assert len(shards) == 4
    outcomes, _ = run_shards(
        tmp_path, tmp_path / "out", shards, jobs=2, paths=["tests"],
        progress=lambda _: None,
    )  # fmt: skip
    assert outcomes == {
        "tests/area/test_kept.py::test_it": "passed",
        "tests/other/test_b.py::test_it": "passed",
    }
    recorded = json.loads((tmp_path / "out" / FILE_TIMES).read_text())["files"]
    assert sorted(recorded) == ["tests/area/test_kept.py", "tests/other/test_b.py"]
    # Each test's CPU seconds, every shard's merged.
    cpu = json.loads((tmp_path / "out" / CPU_TIMES).read_text())["tests"]
    assert sorted(cpu) == sorted(outcomes)


def test_targets_are_directories_unless_a_file_was_named(tmp_path: Path) -> None:
    a = _write(tmp_path / "tests" / "a" / "test_a.py", "")
    b = _write(tmp_path / "tests" / "b" / "test_b.py", "")
    assert targets(tmp_path, ["tests"], [a]) == ["tests"]
    assert targets(tmp_path, ["tests/a", "tests/b"], [b]) == ["tests/b"]
    assert targets(tmp_path, ["tests/a/test_a.py", "tests/b"], [a]) == [
        "tests/a/test_a.py"
    ]


def test_the_loading_files_never_share_a_shard_with_the_others(
    tmp_path: Path,
) -> None:
    """The files that load the MoRIIO package cost 120 s, the others 544 s
    (a gate's shape): every file in one shard, no loading file beside
    another file, the heaviest shards first."""
    loading = [
        _write(tmp_path / "tests" / "patches" / f"test_p{i}.py", f"import {PKG}\n")
        for i in range(4)
    ]
    others = [
        _write(tmp_path / "tests" / "sim" / f"test_s{i}.py", "import os\n")
        for i in range(16)
    ]
    weights = {f: 30.0 for f in loading} | {f: 34.0 for f in others}
    shards = plan(tmp_path, [*loading, *others], 2, weights)
    for shard in shards:
        assert set(shard) <= set(loading) or not set(shard) & set(loading)
    assert sorted(f for s in shards for f in s) == sorted(weights)
    totals = [sum(weights[f] for f in shard) for shard in shards]
    assert totals == sorted(totals, reverse=True)


def test_neighbouring_files_share_a_shard_of_the_share_per_core(
    tmp_path: Path,
) -> None:
    """Files in path order, cut where the next would pass the suite's
    seconds over ``SHARDS_PER_CORE`` per core; a heavier file alone."""
    files = [
        _write(tmp_path / "tests" / d / f"test_{i:02}.py", "import os\n")
        for d in ("a", "b")
        for i in range(12)
    ]
    heavy = _write(tmp_path / "tests" / "c" / "test_heavy.py", "import os\n")
    weights = {f: 1.0 for f in files} | {heavy: 24.0}
    jobs = 2
    target = sum(weights.values()) / (jobs * SHARDS_PER_CORE)
    shards = plan(tmp_path, [*files, heavy], jobs, weights)
    assert shards[0] == [heavy]
    for shard in shards[1:]:
        assert sum(weights[f] for f in shard) <= target
        first = files.index(shard[0])
        assert shard == files[first : first + len(shard)]
    assert len(shards) == 1 + ceil(len(files) / int(target))


# A shard that waits for the shards after it: it passes only if they run
# while it waits, on the core it does not hold.
WAITS = """
import time
from pathlib import Path


def test_it():
    for _ in range(1200):
        if all((Path(__file__).parent / f"{m}.done").exists() for m in "cd"):
            return
        time.sleep(0.05)
    raise AssertionError("the shards after this one did not run beside it")
"""
MARKS = """
from pathlib import Path


def test_it():
    (Path(__file__).parent / "{mark}.done").write_text("")
"""


def test_the_next_shard_goes_to_the_core_that_frees_up(
    tmp_path: Path, importable: None
) -> None:
    """Four shards of equal recorded seconds on two cores; the first takes
    as long as the other three: they run one after the other on the other
    core (shards fixed to cores up front would queue the third behind the
    first, which waits for it)."""
    tests = tmp_path / "tests"
    _write(tests / "test_a.py", WAITS)
    for mark in "bcd":
        _write(tests / f"test_{mark}.py", MARKS.replace("{mark}", mark))
    files = listed(tmp_path, ["tests"])
    shards = plan(tmp_path, files, 2, {f: 1.0 for f in files})
    assert [s[0].name for s in shards] == [f"test_{m}.py" for m in "abcd"]
    outcomes, _ = run_shards(
        tmp_path, tmp_path / "out", shards, jobs=2, progress=lambda _: None
    )
    assert set(outcomes.values()) == {"passed"} and len(outcomes) == 4


def test_the_files_sharing_a_session_fixture_run_in_one_process(
    tmp_path: Path,
) -> None:
    """A conftest's ``SHARED_FIXTURES``: the files under it that request one
    (a test's or a fixture's parameter) form one shard, which the cut by
    seconds would otherwise spread; a file elsewhere asking for the same
    name, or none, is cut as before."""
    tests = tmp_path / "tests"
    _write(tests / "sim" / "conftest.py", 'SHARED_FIXTURES = ("zygote",)\n')
    uses = "def test_it(tmp_path, zygote):\n    pass\n"
    sharing = [_write(tests / "sim" / f"test_z{i}.py", uses) for i in range(3)]
    sharing.append(
        _write(
            tests / "sim" / "deep" / "test_z3.py",
            "import pytest\n\n@pytest.fixture\ndef mine(zygote):\n    pass\n",
        )
    )
    plain = "def test_it(tmp_path):\n    pass\n"
    others = [_write(tests / "sim" / f"test_o{i}.py", plain) for i in range(3)]
    far = "def test_it(zygote):\n    pass\n"
    others.append(_write(tests / "far" / "test_far.py", far))
    weights = {f: 30.0 for f in [*sharing, *others]}
    shards = [set(shard) for shard in plan(tmp_path, list(weights), 2, weights)]
    assert set(sharing) in shards, shards
    assert sorted(f for s in shards for f in s) == sorted(weights)
    assert all(not set(others) & s for s in shards if s == set(sharing))


def test_a_file_without_a_record_is_weighed_by_the_recorded_rate(
    tmp_path: Path,
) -> None:
    old = _write(tmp_path / "tests" / "test_old.py", "x" * 1000)
    new = _write(tmp_path / "tests" / "test_new.py", "x" * 500)
    weights = weigh([old, new], tmp_path, {"tests/test_old.py": 100.0})
    assert weights == {old: START + 100.0, new: START + 50.0}
    # Nothing recorded: size is the proxy, a millisecond a byte.
    assert weigh([old, new], tmp_path, {}) == {old: START + 1.0, new: START + 0.5}


def test_recorded_seconds_from_a_run_or_the_checkouts_file(tmp_path: Path) -> None:
    run = tmp_path / "times.json"
    run.write_bytes(
        msgspec.json.encode(
            Times({"t/a.py::x": 2.0, "t/a.py::y": 3.0, "t/b.py::z": 1.0})
        )
    )
    assert load_file_seconds(run) == {"t/a.py": 5.0, "t/b.py": 1.0}
    assert load_file_seconds(run, {"t/a.py::y"}) == {"t/a.py": 3.0}
    per_file = tmp_path / "file-times.json"
    per_file.write_bytes(msgspec.json.encode(FileTimes({"t/a.py": 4.0})))
    assert load_file_seconds(per_file) == {"t/a.py": 4.0}
    (tmp_path / "bad.json").write_text("{}")
    assert load_file_seconds(tmp_path / "bad.json") is None


def test_the_checkouts_record_is_readable() -> None:
    files = load_file_seconds(REPO / "ci" / "suite-times.json")
    assert files and all(name.startswith("tests/") for name in files)


def test_a_run_that_runs_nothing_fails(tmp_path: Path, importable: None) -> None:
    tests = tmp_path / "tests"
    _write(tests / "conftest.py", 'collect_ignore = ["test_a.py"]\n')
    _write(tests / "test_a.py", "def test_it():\n    pass\n")
    files = listed(tmp_path, ["tests"])
    shards = plan(tmp_path, files, 1, {f: 1.0 for f in files})
    with pytest.raises(ShardError, match="no test ran in 1 shard"):
        run_shards(tmp_path, tmp_path / "out", shards, progress=lambda _: None)


def test_unit_hands_the_paths_to_the_shards_and_the_rest_to_pytest() -> None:
    args = ["tests/gate", "-k", "tests", "-x", "tests/image", "-p", "tests"]
    assert split_paths(REPO, args) == (
        ["tests/gate", "tests/image"],
        ["-k", "tests", "-x", "-p", "tests"],
    )
    assert split_paths(REPO, ["no/such/dir"]) == ([], ["no/such/dir"])
    assert names_a_test(["tests/series/test_pin.py::test_x"])
    assert not names_a_test(["tests/gate", "-k", "a and not b"])


def test_the_unit_run_fails_on_a_failed_test_and_lists_the_slowest(
    tmp_path: Path, importable: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """`suite --no-evidence --check` (what `nox -s unit` runs): exit
    status 1 when a test fails, 0 without --check; no evidence written;
    the slow test listed."""
    repo = tmp_path / "repo"
    _write(repo / "patches" / "series", "# test series\n")
    shutil.copy(REPO / "pin.toml", repo / "pin.toml")
    _write(repo / "tests" / "test_a.py", "def test_fails():\n    assert False\n")
    _write(
        repo / "tests" / "test_b.py",
        "import time\n\ndef test_slow():\n    time.sleep(2.1)\n",
    )
    argv = ["--repo", str(repo), "suite", "--out", str(tmp_path / "out")]
    assert main([*argv, "--no-evidence", "--check", "--jobs", "2"]) == 1
    said = capsys.readouterr().out
    assert "tests/test_b.py::test_slow" in said.split("slowest tests")[1]
    assert said.rstrip().endswith("suite (overlay): 2 tests, 1 failed")
    assert not (tmp_path / "out" / "touches.json").exists()
    assert main([*argv, "--no-evidence"]) == 0


def test_the_warm_children_are_one_line_with_why_the_others_started_cold() -> None:
    log = (
        "warm\tvllm_overlay.simulate.worker\nwarm\t-c\n"
        "cold\tenvironment differs in VLLM_OVERLAY_SIMULATE_CORE_DIR\n"
        "cold\targuments other than [-P] -m/-c: -u -c\n"
        "cold\tenvironment differs in VLLM_OVERLAY_SIMULATE_CORE_DIR\n"
    )
    assert warm_summary(log) == (
        "suite: 2 Python children forked warm, 3 started cold: environment "
        "differs in VLLM_OVERLAY_SIMULATE_CORE_DIR (2); arguments other than "
        "[-P] -m/-c: -u -c (1)"
    )
    assert warm_summary("warm\t-c\n") == "suite: 1 Python child forked warm"


def test_the_server_loads_the_third_party_modules_the_files_import(
    tmp_path: Path,
) -> None:
    _write(tmp_path / "tests" / "conftest.py", "import hypothesis\nimport json\n")
    test = _write(
        tmp_path / "tests" / "test_x.py",
        f"import msgspec\nfrom vllm.config import VllmConfig\nfrom {PKG} import x\n"
        "from tests import helper\n",
    )
    _write(tmp_path / "tests" / "helper.py", "import tomli_w\n")
    names = preload_names(tmp_path, [test])
    # vLLM's modules first, the MoRIIO package left to the runs.
    assert names[:2] == ["vllm.config", "vllm.config.VllmConfig"]
    assert {"hypothesis", "msgspec", "tomli_w"} <= set(names[2:])
    assert not any(n.startswith(PKG) for n in names)
    assert "json" not in names and not any(n.startswith("tests") for n in names)


def test_a_shard_writing_outside_the_checkout_keeps_its_settings(
    tmp_path: Path, importable: None
) -> None:
    """pytest finds its configuration above the arguments' common directory:
    a shard's outputs in $TMPDIR would move it to /, the checkout's settings
    (here: warnings are errors) left behind."""
    root = tmp_path / "repo"
    _write(
        root / "pyproject.toml",
        '[tool.pytest.ini_options]\nfilterwarnings = ["error"]\n',
    )
    _write(
        root / "tests" / "test_w.py",
        "import warnings\n\ndef test_it():\n    warnings.warn('settings')\n",
    )
    files = listed(root, ["tests"])
    outcomes, _ = run_shards(
        root, tmp_path / "elsewhere", [files], paths=["tests"],
        progress=lambda _: None,
    )  # fmt: skip
    assert outcomes == {"tests/test_w.py::test_it": "failed"}
