"""Porting a patch's tests to one self-contained vLLM test file."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_overlay.series.patch_series import load_series
from vllm_overlay.upstream.testport import (
    SPDX_HEADER,
    PortError,
    port_test,
    upstream_test_path,
)

CONFTEST = '''"""Builders."""

from __future__ import annotations

from typing import TYPE_CHECKING

from helpers import shared_helper

if TYPE_CHECKING:
    from collections.abc import Sequence

BLOCK = 16


def build(xs: Sequence[int]) -> list[int]:
    return [shared_helper(x) for x in xs]
'''

HELPERS = '''"""Helpers, also a script."""

import sys


def shared_helper(x: int) -> int:
    return x * BLOCK_FACTOR


BLOCK_FACTOR = 2


def main() -> None:
    print(sys.argv)


if __name__ == "__main__":
    main()
'''

TEST = '''"""Patch 0042: the thing works."""

import pytest
from conftest import build as make
from tests.patches.helpers import shared_helper


@pytest.mark.parametrize("n", [1, 2])
def test_thing(n: int) -> None:
    assert make([n]) == [shared_helper(n)]
'''


def _layout(tmp_path: Path, **files: str) -> Path:
    d = tmp_path / "tests" / "patches"
    d.mkdir(parents=True)
    for name, text in files.items():
        (d / f"{name}.py").write_text(text)
    return d


def _run_alone(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """pytest on the ported ``text`` alone, in a directory of its own."""
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "test_port.py").write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=alone,
    )


def test_port_inlines_across_local_modules(tmp_path: Path) -> None:
    d = _layout(tmp_path, conftest=CONFTEST, helpers=HELPERS, test_0042_thing=TEST)
    out = port_test(d / "test_0042_thing.py")
    assert out.startswith(SPDX_HEADER + '"""The thing works."""\n')
    tree = ast.parse(out)
    defined = {
        n.name if isinstance(n, ast.FunctionDef) else ast.unparse(n.targets[0])
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.Assign)
    }
    assert defined == {"build", "shared_helper", "BLOCK_FACTOR", "make", "test_thing"}
    assert "BLOCK = 16" not in out and "def main" not in out
    assert "make = build" in out
    assert "if TYPE_CHECKING:\n    from collections.abc import Sequence" in out
    assert "conftest" not in out and "helpers" not in out and "tests." not in out
    # It runs: the inlined definitions resolve at call time.
    namespace: dict[str, object] = {}
    exec(compile(out, "ported.py", "exec"), namespace)
    namespace["test_thing"](3)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("test", "message"),
    [
        (
            "import helpers\n\n\ndef test_x():\n    helpers.shared_helper(1)\n",
            "uses a local",
        ),
        (
            "from vllm_overlay.series.pin import Pin\n\n\ndef test_x():\n    Pin\n",
            "'vllm_overlay', which is not in vLLM's tree",
        ),
        (
            "from tests.overlay.workspace import REPO\n\n\ndef test_x():\n    REPO\n",
            "'tests', which is not in vLLM's tree",
        ),
    ],
)
def test_unportable_tests_are_refused(tmp_path: Path, test: str, message: str) -> None:
    d = _layout(tmp_path, conftest=CONFTEST, helpers=HELPERS, test_0042_x=test)
    with pytest.raises(PortError, match=message):
        port_test(d / "test_0042_x.py")


def test_a_name_two_local_modules_define(tmp_path: Path) -> None:
    # helpers.py also defines `build`: fine while only conftest's is needed.
    clash = HELPERS + "\n\ndef build(xs):\n    return xs\n"
    d = _layout(tmp_path, conftest=CONFTEST, helpers=clash, test_0042_thing=TEST)
    out = port_test(d / "test_0042_thing.py")
    assert out.count("def build(") == 1 and "shared_helper(x) for x in xs" in out
    # Both needed: refused, naming both modules.
    both = (
        TEST + "\n\nfrom helpers import build as hb\n\n\ndef test_b():\n    hb([1])\n"
    )
    (d / "test_0042_thing.py").write_text(both)
    with pytest.raises(PortError, match="'build' is needed from both"):
        port_test(d / "test_0042_thing.py")


def test_a_test_running_a_local_module_as_a_file_is_refused(tmp_path: Path) -> None:
    script = (
        "import subprocess\nimport sys\nfrom pathlib import Path\n\n\n"
        "def test_x():\n    subprocess.run([sys.executable, "
        'str(Path(__file__).parent / "helpers.py")], check=True)\n'
    )
    d = _layout(tmp_path, conftest=CONFTEST, helpers=HELPERS, test_0042_x=script)
    with pytest.raises(PortError, match="runs or reads helpers.py as a file"):
        port_test(d / "test_0042_x.py")


def test_upstream_names() -> None:
    assert upstream_test_path(
        Path("tests/patches/test_0001_hybrid_multi_group.py")
    ) == ("tests/v1/kv_connector/unit/test_moriio_hybrid_multi_group.py")
    assert upstream_test_path(Path("tests/patches/test_moriio_x.py")) == (
        "tests/v1/kv_connector/unit/test_moriio_x.py"
    )


# A helper module that imports `cdiv` from outside (for a definition the
# port does not need) beside one that defines its own `cdiv` (needed).
OUTSIDE_CDIV = '''"""Imports cdiv from outside."""

from math import ceil as cdiv


def unused_here(a: int) -> int:
    return cdiv(a)
'''

OWN_CDIV = '''"""Defines its own cdiv."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
'''

CONFTEST_IMPORTING = '''"""Fixtures."""

from outside import unused_here
'''


def _top_level_bindings(source: str) -> list[str]:
    """Every name the module's top level binds, once per binding."""
    out: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out += [a.asname or a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            out.append(node.name)
        elif isinstance(node, ast.Assign):
            out += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return out


def test_an_import_of_a_module_the_port_draws_nothing_from_is_left_out(
    tmp_path: Path,
) -> None:
    # `outside` is loaded (conftest imports from it) but nothing of it is
    # needed: its `from math import ceil as cdiv` must not land beside the
    # inlined `def cdiv` (ruff: F811 redefinition).
    test = (
        "from own import cdiv\n\n\ndef test_x() -> None:\n    assert cdiv(7, 2) == 4\n"
    )
    d = _layout(
        tmp_path,
        conftest=CONFTEST_IMPORTING,
        outside=OUTSIDE_CDIV,
        own=OWN_CDIV,
        test_0042_x=test,
    )
    out = port_test(d / "test_0042_x.py")
    assert "import ceil" not in out
    bindings = _top_level_bindings(out)
    assert bindings.count("cdiv") == 1
    namespace: dict[str, object] = {}
    exec(compile(out, "ported.py", "exec"), namespace)
    namespace["test_x"]()  # type: ignore[operator]


def test_an_import_wins_over_a_conftest_name(tmp_path: Path) -> None:
    # The test imports `build` from outside; conftest's `build` is not it.
    test = (
        "from os.path import join as build\n\n\ndef test_x() -> None:\n"
        "    assert build('a', 'b')\n"
    )
    d = _layout(tmp_path, conftest=CONFTEST, helpers=HELPERS, test_0042_x=test)
    out = port_test(d / "test_0042_x.py")
    assert "def build" not in out and "shared_helper" not in out
    assert _top_level_bindings(out).count("build") == 1


def test_a_name_both_imported_and_defined_by_what_the_port_needs(
    tmp_path: Path,
) -> None:
    # `outside.unused_here` (needed now) means math's ceil by `cdiv`, the
    # test means own.py's: one file cannot hold both.
    test = (
        "from outside import unused_here\nfrom own import cdiv\n\n\n"
        "def test_x() -> None:\n    assert cdiv(unused_here(3), 2) == 2\n"
    )
    d = _layout(tmp_path, outside=OUTSIDE_CDIV, own=OWN_CDIV, test_0042_x=test)
    with pytest.raises(
        PortError,
        match=r"'cdiv' is both imported by outside.py .* and defined in own.py",
    ):
        port_test(d / "test_0042_x.py")


REPO = Path(__file__).resolve().parents[2]


def _series_test_files() -> list[Path]:
    """The test files the series' headers name: what export ports."""
    series = load_series(REPO)
    named = {t.split("::", 1)[0] for p in series.patches for t in p.header.tests}
    return [REPO / f for f in sorted(named)]


@functools.cache
def _series_ports() -> dict[Path, str | PortError]:
    """Each of those files' port, or why it has none: made once for the
    two tests below."""
    ports: dict[Path, str | PortError] = {}
    for test_file in _series_test_files():
        try:
            ports[test_file] = port_test(test_file)
        except PortError as e:
            ports[test_file] = e
    return ports


def test_the_series_tests_port_with_each_name_bound_once() -> None:
    twice = {}
    for test_file, port in _series_ports().items():
        if isinstance(port, PortError):
            raise port
        bindings = _top_level_bindings(port)
        dup = sorted({n for n in bindings if bindings.count(n) > 1})
        if dup:
            twice[test_file.name] = dup
    assert not twice


# Names of this repository a ported file must not hold (checked here by its
# own pattern, not by the porter's).
_OURS = re.compile(
    r"vllm_overlay|vllm-overlay|tests[/.]patches|\bbuilders\.py|"
    r"\b(?:hybrid|pairing|prefix_hit|scheduler_pair)_\d{4}\b|"
    r"\b[Pp]atch(?:es)? \d{4}\b|(?<![\w.])0\d{3}(?![\w.])"
)


def test_the_series_ports_read_like_vllms_tests() -> None:
    """No port names this repository (its helper modules, its package, a
    patch number); a port drawing on the scheduler pair builds its
    schedulers with vLLM's ``create_scheduler`` from vLLM's unit ``utils``."""
    ours: dict[str, list[str]] = {}
    with_vllm_helpers = []
    for test_file, text in _series_ports().items():
        if isinstance(text, PortError):
            ours[test_file.name] = [str(text)]
            continue
        hits = [ln.strip() for ln in text.splitlines() if _OURS.search(ln)]
        if hits:
            ours[test_file.name] = hits
        if "from .utils import" in text:
            with_vllm_helpers.append(test_file.name)
            assert "def create_scheduler" not in text
    assert not ours
    assert "test_0016_refusals_fall_back.py" in with_vllm_helpers


def test_a_port_that_names_this_repository_is_refused(tmp_path: Path) -> None:
    d = _layout(
        tmp_path,
        prefix_hit_0042=(
            "def build() -> int:\n    # since patch 0008 this is one\n    return 1\n"
        ),
        test_0042_x=(
            '"""Patch 0042: driven on both legs (see ``prefix_hit_0042``)."""\n\n'
            "from prefix_hit_0042 import build\n\n\n"
            "def test_x() -> None:\n    assert build() == 1\n"
        ),
    )
    with pytest.raises(PortError) as e:
        port_test(d / "test_0042_x.py")
    message = str(e.value)
    assert message.startswith("the port names this repository, not vLLM: line ")
    assert "'prefix_hit_0042'" in message and "'0008'" in message


def test_vllms_unit_helpers_are_imported_not_inlined(tmp_path: Path) -> None:
    d = _layout(
        tmp_path,
        vllm_unit_utils=(
            "def create_scheduler(vllm_config: object) -> object:\n"
            "    return vllm_config\n"
        ),
        pair=(
            "from tests.patches.vllm_unit_utils import create_scheduler\n\n\n"
            "def build_pair() -> tuple[object, object]:\n"
            "    return create_scheduler(1), create_scheduler(2)\n"
        ),
        test_0042_x=(
            '"""Two real schedulers."""\n\n'
            "from pair import build_pair\n\n\n"
            "def test_x() -> None:\n    assert build_pair() == (1, 2)\n"
        ),
    )
    text = port_test(d / "test_0042_x.py")
    assert "from .utils import create_scheduler\n" in text
    assert "def create_scheduler" not in text
    assert "def build_pair" in text


def test_a_name_a_function_binds_pulls_no_builder_in(tmp_path: Path) -> None:
    """One helper module holds every builder: a local variable, a loop
    variable or a parameter named like another builder is not that builder."""
    helpers = (
        "def table() -> list[int]:\n    return [9]\n\n\n"
        "def connector(x: int) -> int:\n    return x\n\n\n"
        "def build(table: int) -> int:\n"
        "    connector = table + 1\n"
        "    return sum(connector for _ in [0])\n"
    )
    d = _layout(
        tmp_path,
        builders=helpers,
        test_0042_x=(
            "from builders import build\n\n\n"
            "def test_x() -> None:\n    assert build(1) == 2\n"
        ),
    )
    text = port_test(d / "test_0042_x.py")
    assert "def build" in text
    assert "def table" not in text and "def connector" not in text


def test_a_parameter_names_a_conftest_fixture(tmp_path: Path) -> None:
    conftest = (
        "import pytest\n\n\n@pytest.fixture\ndef model_dir() -> str:\n"
        "    return 'm'\n\n\ndef unrelated() -> int:\n    return 0\n"
    )
    d = _layout(
        tmp_path,
        conftest=conftest,
        test_0042_x="def test_x(model_dir: str) -> None:\n    assert model_dir\n",
    )
    text = port_test(d / "test_0042_x.py")
    assert "def model_dir" in text and "def unrelated" not in text


def test_a_fixture_asked_for_by_name_runs_alone(tmp_path: Path) -> None:
    """A helper that picks a conftest fixture by string
    (``request.getfixturevalue``) and a test marked ``usefixtures`` get
    those fixtures inlined: the port runs alone, with no conftest."""
    conftest = (
        "import pytest\n\n\n"
        "@pytest.fixture(scope='session')\ndef small_dir() -> str:\n"
        "    return 'small'\n\n\n"
        "@pytest.fixture(scope='session')\ndef big_dir() -> str:\n"
        "    return 'big'\n\n\n"
        "@pytest.fixture\ndef marker(record: list[str]) -> None:\n"
        "    record.append('marked')\n\n\n"
        "@pytest.fixture\ndef record() -> list[str]:\n    return []\n\n\n"
        "@pytest.fixture\ndef unrelated() -> int:\n    return 0\n"
    )
    test = (
        "import pytest\n\n\n"
        "def _model_dir(big: bool, request: pytest.FixtureRequest) -> str:\n"
        "    name = 'big_dir' if big else 'small_dir'\n"
        "    return request.getfixturevalue(name)\n\n\n"
        "@pytest.mark.parametrize('big', [False, True])\n"
        "def test_x(big: bool, request: pytest.FixtureRequest) -> None:\n"
        "    assert _model_dir(big, request) == ('big' if big else 'small')\n\n\n"
        "@pytest.mark.usefixtures('marker')\n"
        "def test_marked(record: list[str]) -> None:\n"
        "    assert record == ['marked']\n"
    )
    d = _layout(tmp_path, conftest=conftest, test_0042_x=test)
    text = port_test(d / "test_0042_x.py")
    assert "def unrelated" not in text
    run = _run_alone(tmp_path, text)
    assert run.returncode == 0, run.stdout
    assert "3 passed" in run.stdout


def test_a_fixture_imported_from_another_test_module_runs_alone(
    tmp_path: Path,
) -> None:
    """A fixture the test module imports from a sibling test module and names
    only as a parameter is inlined; a helper's parameter named like a
    non-fixture definition pulls nothing in."""
    sibling = (
        "import pytest\n\n\n"
        "@pytest.fixture\ndef outbox() -> list[str]:\n    return ['x']\n\n\n"
        "def table() -> int:\n    return 9\n"
    )
    test = (
        "from test_0041_y import outbox, table  # noqa: F401\n\n\n"
        "def _size(table: list[str]) -> int:\n    return len(table)\n\n\n"
        "def test_x(outbox: list[str]) -> None:  # noqa: F811\n"
        "    assert _size(outbox) == 1\n"
    )
    d = _layout(tmp_path, test_0041_y=sibling, test_0042_x=test)
    text = port_test(d / "test_0042_x.py")
    assert "def outbox" in text and "def table" not in text
    run = _run_alone(tmp_path, text)
    assert run.returncode == 0, run.stdout
    assert "1 passed" in run.stdout
