"""The base run's selection: the evidence of which tests read vLLM's
installed MoRIIO package, the import analysis that keeps the files loading
it apart, and the gate's check of the selection against the outcomes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.repo import REPO
from vllm_overlay.gate import imports
from vllm_overlay.gate.cli import below_first
from vllm_overlay.gate.evidence import Selection, Touches, select
from vllm_overlay.gate.imports import imports_package
from vllm_overlay.gate.revert_red import evidence_problems
from vllm_overlay.gate.stack import named_tests
from vllm_overlay.series.patch_series import load_series

PKG = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"


def _touches() -> Touches:
    return Touches(
        ["/x"],
        {"t.py::a": ["read"], "t.py::b": [], "u.py::c": [], "u.py::d": ["ran"]},
    )


def test_select_keeps_every_touched_test_and_samples_the_others() -> None:
    sel = select(_touches(), 1, "seed")
    assert sel.touched == ["t.py::a", "u.py::d"]
    assert len(sel.sample) == 1 and sel.sample[0] in ("t.py::b", "u.py::c")
    assert select(_touches(), 1, "seed") == sel  # the same seed, the same sample
    assert sorted(select(_touches(), 5, "seed").sample) == ["t.py::b", "u.py::c"]


def test_half_the_sample_is_of_the_tests_that_only_had_the_package_loaded() -> None:
    tests: dict[str, list[str]] = {f"f{i}.py::t": [] for i in range(8)}
    loaded = [f"f{i}.py::t" for i in range(3)]
    sel = select(Touches(["/x"], {**tests, "g.py::t": ["ran"]}, loaded), 4, "seed")
    assert sel.touched == ["g.py::t"]
    assert len(sel.sample) == 4 and len(set(sel.sample) & set(loaded)) == 2
    # Too few of the others: the loaded-only ones fill the sample.
    few = Touches(["/x"], {t: [] for t in [*loaded, "f7.py::t"]}, loaded)
    assert sorted(select(few, 4, "seed").sample) == sorted([*loaded, "f7.py::t"])


def test_the_first_patchs_named_tests_run_on_the_base_whatever_they_read() -> None:
    """The base run is the stack below the first patch: its named tests run
    there even without evidence; other tests keep theirs."""
    series = load_series(REPO)
    first = named_tests(series.patches[0])[0]
    last = named_tests(series.patches[-1])[0]
    touches = Touches(["/x"], {first: [], last: [], "a.py::b": []}, [first, last])
    got = below_first(touches, series)
    assert got.tests == {first: ["named by the first patch"], last: [], "a.py::b": []}
    assert got.loaded == [last]


def test_evidence_holds_when_the_base_ran_what_it_must() -> None:
    sel = Selection(["t.py::a", "u.py::d"], ["u.py::c"])
    base = {"t.py::a": "failed", "u.py::d": "passed", "u.py::c": "passed"}
    overlay = dict.fromkeys(["t.py::a", "t.py::b", "u.py::c", "u.py::d"], "passed")
    assert evidence_problems(_touches(), sel, base=base, overlay=overlay) == []


def test_a_touched_test_missing_on_the_base_fails_the_gate() -> None:
    sel = Selection(["t.py::a", "u.py::d"], [])
    base = {"t.py::a": "failed"}
    problems = evidence_problems(_touches(), sel, base=base, overlay={})
    assert problems == [
        "u.py::d may read vLLM's MoRIIO package (ran) but did not run on the base"
    ]


def test_a_selection_leaving_out_a_touched_test_fails_the_gate() -> None:
    sel = Selection(["t.py::a"], [])
    base = {"t.py::a": "failed", "u.py::d": "passed"}
    problems = evidence_problems(_touches(), sel, base=base, overlay={})
    assert problems[0].startswith("the selection leaves out 1 test that may read")


def test_a_sampled_test_that_changes_outcome_fails_the_gate() -> None:
    sel = Selection(["t.py::a", "u.py::d"], ["u.py::c"])
    base = {"t.py::a": "failed", "u.py::d": "passed", "u.py::c": "failed"}
    overlay = {"t.py::a": "passed", "u.py::d": "passed", "u.py::c": "passed"}
    problems = evidence_problems(_touches(), sel, base=base, overlay=overlay)
    assert problems == [
        "u.py::c reads nothing of vLLM's MoRIIO package with the overlay, yet is "
        "failed on the base and passed with the overlay: the evidence missed a "
        "dependence"
    ]


def test_a_test_without_evidence_fails_the_gate() -> None:
    sel = Selection(["t.py::a", "u.py::d"], [])
    base = {"t.py::a": "failed", "u.py::d": "passed"}
    overlay = {"t.py::a": "passed", "new.py::e": "passed"}
    problems = evidence_problems(_touches(), sel, base=base, overlay=overlay)
    assert problems == [
        "new.py::e ran with the overlay but has no evidence of what it reads"
    ]


def test_imports_package_follows_module_level_imports_only(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "helper.py").write_text(
        f"from {PKG}.moriio_connector import X\n"
    )
    (tmp_path / "tests" / "test_via_helper.py").write_text(
        "from tests.helper import X\n"
    )
    (tmp_path / "tests" / "test_lazy.py").write_text(
        f"def test_x():\n    from {PKG} import moriio_common\n"
    )
    (tmp_path / "tests" / "test_typing.py").write_text(
        f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import {PKG}\n"
    )
    tests = tmp_path / "tests"
    assert imports_package(tests / "test_via_helper.py", tmp_path, PKG)
    assert not imports_package(tests / "test_lazy.py", tmp_path, PKG)
    assert not imports_package(tests / "test_typing.py", tmp_path, PKG)
    sub = tests / "sub"
    sub.mkdir()
    (sub / "conftest.py").write_text(f"import {PKG}\n")
    (sub / "test_plain.py").write_text("def test_x():\n    pass\n")
    assert imports_package(sub / "test_plain.py", tmp_path, PKG)  # its conftest


def test_each_module_is_parsed_once_for_every_test_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards' plan asks for every test file's imports: the checkout's
    modules they share are read once (it cost 17 CPU-seconds a plan)."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "__init__.py").write_text("")
    (tests / "helper.py").write_text("import tests.deep\n")
    (tests / "deep.py").write_text(f"import {PKG}\n")
    for i in range(5):
        (tests / f"test_{i}.py").write_text("from tests.helper import x\n")
    parsed: list[str] = []
    real = imports.ast.parse

    def counting(source: str, filename: str = "", *args: Any, **kw: Any) -> Any:
        if Path(filename).is_relative_to(tests):
            parsed.append(Path(filename).name)
        return real(source, filename, *args, **kw)

    monkeypatch.setattr(imports.ast, "parse", counting)
    assert all(imports_package(tests / f"test_{i}.py", tmp_path, PKG) for i in range(5))
    assert sorted(parsed) == sorted(
        ["helper.py", "deep.py", *(f"test_{i}.py" for i in range(5))]
    ), parsed


def test_the_plugin_sees_reads_in_the_test_and_in_a_child(tmp_path: Path) -> None:
    """The real plugin in a real pytest: a test opening a file of the
    installed package, one whose child Python does, one that does neither,
    one whose child drops the hook from its environment."""
    (tmp_path / "test_probe.py").write_text(
        textwrap.dedent(
            """
            import os, subprocess, sys
            from vllm_overlay.tree.variant import installed_moriio_dir

            INIT = str(installed_moriio_dir() / "__init__.py")

            def test_reads():
                open(INIT).close()

            def test_child_reads():
                subprocess.run([sys.executable, "-c", f"open({INIT!r}).close()"],
                               check=True)

            def test_nothing():
                subprocess.run([sys.executable, "-c", "pass"], check=True)

            def test_hidden_child():
                env = {"PATH": os.environ["PATH"]}
                subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
            """
        )
    )
    out = tmp_path / "touches.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-p", "vllm_overlay.gate.touch",
         "--touch-json", str(out), "test_probe.py"],
        cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    tests = json.loads(out.read_text())["tests"]
    assert tests == {
        "test_probe.py::test_reads": ["read"],
        "test_probe.py::test_child_reads": ["read"],
        "test_probe.py::test_nothing": [],
        "test_probe.py::test_hidden_child": ["untracked child"],
    }


# The parents of vLLM's MoRIIO package as bare packages over their installed
# directories: its modules import without vLLM's start-up.
PARENTS = """
import importlib, sys, types
from vllm_overlay.series.pin import MODULE_PACKAGE
from vllm_overlay.tree.variant import installed_moriio_dir

directory = installed_moriio_dir()
parts = MODULE_PACKAGE.split(".")
for i in range(1, len(parts)):
    parent = types.ModuleType(".".join(parts[:i]))
    parent.__path__ = [str(directory.parents[len(parts) - 1 - i])]
    sys.modules[parent.__name__] = parent
NAME = MODULE_PACKAGE + ".moriio_tp_mapping"
"""


def test_the_plugin_sees_the_package_run_not_merely_loaded(tmp_path: Path) -> None:
    """A test that calls the installed package's code (in this process, a
    thread, a forked child, a child Python) or looks up a value of it counts
    as touching it; one that only finds its modules loaded does not, and is
    listed as loaded. A module of the package loaded by a loader of its own
    runs unseen: every test from then on counts."""
    (tmp_path / "parents.py").write_text(PARENTS)
    (tmp_path / "test_probe.py").write_text(
        textwrap.dedent(
            """
            import importlib.util, os, subprocess, sys, threading
            from parents import NAME, directory

            HELD = []
            CHILD = (
                f"import parents, importlib; "
                f"importlib.import_module({NAME!r})._rank_heads(0, 1, 1)"
            )

            def test_loads():
                HELD.append(importlib.import_module(NAME)._rank_heads)

            def test_only_loaded():
                assert NAME in sys.modules

            def test_looks_up_a_value():
                assert sys.modules[NAME].WriteTarget.__name__ == "WriteTarget"

            def test_imports_a_loaded_module():
                exec(f"from {NAME} import WriteTarget")  # the statement, as written

            def test_calls():
                assert list(HELD[0](0, 1, 1)) == [0]

            def test_in_a_thread():
                t = threading.Thread(target=HELD[0], args=(0, 1, 1))
                t.start()
                t.join()

            def test_in_a_forked_child():
                pid = os.fork()
                if pid == 0:
                    HELD[0](0, 1, 1)
                    os._exit(0)
                assert os.waitpid(pid, 0)[1] == 0

            def test_in_a_child_python():
                subprocess.run([sys.executable, "-c", CHILD], check=True)

            def test_loaded_again():
                pass

            def test_loads_its_own_way():
                path = directory / "moriio_tp_mapping.py"
                name = NAME.rpartition(".")[0] + ".own_way"
                spec = importlib.util.spec_from_file_location(name, path)
                sys.modules[name] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(sys.modules[name])

            def test_after_it():
                pass
            """
        )
    )
    out = tmp_path / "touches.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-p", "vllm_overlay.gate.touch",
         "--touch-json", str(out), "test_probe.py"],
        cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    touches = json.loads(out.read_text())
    assert touches["tests"] == {
        "test_probe.py::test_loads": ["read", "used"],
        "test_probe.py::test_only_loaded": [],
        "test_probe.py::test_looks_up_a_value": ["used"],
        "test_probe.py::test_imports_a_loaded_module": ["used"],
        "test_probe.py::test_calls": ["ran"],
        "test_probe.py::test_in_a_thread": ["ran"],
        "test_probe.py::test_in_a_forked_child": ["ran"],
        "test_probe.py::test_in_a_child_python": ["read", "used"],
        "test_probe.py::test_loaded_again": [],
        "test_probe.py::test_loads_its_own_way": ["read", "unmarked"],
        "test_probe.py::test_after_it": ["unmarked"],
    }
    assert touches["loaded"] == [
        "test_probe.py::test_loaded_again",
        "test_probe.py::test_only_loaded",
    ]
