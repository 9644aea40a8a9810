"""How a byte-level sweep hands out its configurations: each runs exactly
once per variant, the costliest kinds first; a variant that finishes early
gives its place to another zygote of the other; a zygote that fails stops
the sweep with its own last lines; a test session's zygote runs plan after
plan. Fake zygotes (a few lines of Python speaking the zygote's stdin/stdout
protocol) stand in for the real ones."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import msgspec
import pytest

from vllm_overlay.simulate.bytes import run
from vllm_overlay.simulate.bytes.dispatch import Dispatcher, order, variant_orders
from vllm_overlay.simulate.bytes.report import ConfigItem, ConfigReport, ZygoteLine
from vllm_overlay.simulate.bytes.run import plan_items
from vllm_overlay.simulate.bytes.zygote import MARK, plan_of

_FAKE = textwrap.dedent(
    """
    import json, os, sys, time
    variant, delay, fail_after = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    print("importing vLLM (not really)", flush=True)
    done = 0
    for line in sys.stdin:
        if done == fail_after:
            print("boom: the fake zygote fails here", flush=True)
            sys.exit(3)
        item = json.loads(line)
        time.sleep(delay)
        report = {"type": "bytes-config", "variant": variant, "item": item,
                  "first_errors": [str(os.getpid())]}
        print(MARK + json.dumps(report), flush=True)
        done += 1
    """
).replace("MARK", repr(MARK))


def _items(count: int) -> list[ConfigItem]:
    return [ConfigItem(f"l{k}", "read", 1, 1, "LBNHC") for k in range(count)]


class _Fakes:
    """Starts fake zygotes; checks no two running ones share a port range."""

    def __init__(self, delays: dict[str, float], fail: str | None = None) -> None:
        self.delays = delays
        self.fail = fail
        self.procs: list[tuple[tuple[int, int], subprocess.Popen[str]]] = []

    def __call__(self, variant: str, ports: tuple[int, int]) -> subprocess.Popen[str]:
        running = [r for r, p in self.procs if p.poll() is None]
        assert ports not in running, f"ports {ports} handed out twice"
        fail_after = 1 if variant == self.fail else -1
        proc = subprocess.Popen(
            [sys.executable, "-c", _FAKE, variant, str(self.delays[variant])]
            + [str(fail_after)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.procs.append((ports, proc))
        return proc


def _run(queues, fakes, ranges, helper_items):
    got: list[ConfigReport] = []
    dispatcher = Dispatcher(
        queues,
        fakes,
        ranges,
        1,
        got.append,
        MARK,
        msgspec.json.Decoder(ZygoteLine),
        helper_items=helper_items,
    )
    dispatcher.run()
    return dispatcher, got


def test_every_item_runs_once_and_a_late_variant_gets_a_helper():
    items = _items(24)
    fakes = _Fakes({"base": 0.0, "overlay": 0.05})
    dispatcher, got = _run(
        {"base": items, "overlay": items}, fakes, [(1, 2), (3, 4)], helper_items=3
    )
    for variant in ("base", "overlay"):
        ran = [r.item for r in got if r.variant == variant]
        assert sorted(ran, key=items.index) == items, variant
    # The base finished first and its place went to a second overlay zygote,
    # which ran some of the overlay's items.
    assert dispatcher.started == ["base", "overlay", "overlay"]
    pids = {r.first_errors[0] for r in got if r.variant == "overlay"}
    assert len(pids) == 2
    assert all(p.returncode == 0 for _, p in fakes.procs)


def test_no_helper_for_fewer_items_than_a_zygote_is_worth():
    items = _items(6)
    fakes = _Fakes({"base": 0.0, "overlay": 0.05})
    dispatcher, got = _run(
        {"base": items, "overlay": items}, fakes, [(1, 2), (3, 4)], helper_items=12
    )
    assert dispatcher.started == ["base", "overlay"]
    assert len(got) == 12


def test_a_failing_zygote_stops_the_sweep_with_its_last_lines():
    items = _items(50)
    fakes = _Fakes({"base": 0.0, "overlay": 0.2}, fail="base")
    with pytest.raises(RuntimeError) as raised:
        _run({"base": items, "overlay": items}, fakes, [(1, 2), (3, 4)], 3)
    assert "byte simulator base #1 exited 3" in str(raised.value)
    assert "boom: the fake zygote fails here" in str(raised.value)
    for _, proc in fakes.procs:  # the overlay's zygote was stopped too
        assert proc.wait(10) is not None


@pytest.mark.parametrize("families_first", [True, False])
def test_families_first_or_last_then_the_widest_otherwise_in_plan_order(
    families_first,
):
    items = plan_items(
        ["llama", "llama/dcp2", "gemma3", "kimi"], ["read"], None, ["LBNHC"]
    )
    handed = order(items, {"gemma3"}, families_first)
    assert sorted(handed, key=items.index) == items
    assert (handed[0].layout == "gemma3") is families_first
    assert (handed[-1].layout == "gemma3") is not families_first
    mechanism = [item for item in handed if item.layout != "gemma3"]
    ranks = [item.p_tp + item.d_tp for item in mechanism]
    assert ranks == sorted(ranks, reverse=True)
    for a, b in zip(mechanism, mechanism[1:], strict=False):
        if a.p_tp + a.d_tp == b.p_tp + b.d_tp:
            assert items.index(a) < items.index(b)


def test_the_overlay_takes_the_families_first_and_the_base_last():
    items = plan_items(["llama", "gemma3"], ["read"], [(1, 1)], ["LBNHC"])
    orders = variant_orders(items, {"gemma3"}, ["base", "overlay"])
    assert orders["overlay"][0].layout == "gemma3"
    assert orders["base"][-1].layout == "gemma3"
    assert variant_orders(items, {"gemma3"}, ["base"])["base"][0].layout == "gemma3"


def test_a_zygote_reads_its_plan_from_stdin_or_the_command_line(monkeypatch):
    items = _items(3)
    lines = "".join(msgspec.json.encode(item).decode() + "\n" for item in items)
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines + "\n"))
    assert list(plan_of("-")) == items
    assert list(plan_of(msgspec.json.encode(items).decode())) == items


def test_the_summary_says_how_many_zygotes_each_variant_ran():
    from vllm_overlay.simulate.bytes.report import BytesReport, summary_line

    report = BytesReport(
        lengths=[2],
        hits=[0.0],
        variants={"base": "wheel", "overlay": "series"},
        configs=[],
        wall_seconds=1.0,
        zygotes={"base": 1, "overlay": 2},
    )
    assert summary_line(report).endswith("; zygotes base 1, overlay 2")


def test_a_child_runs_this_checkout_from_any_directory(tmp_path, monkeypatch):
    """A sweep's processes import the checkout the command runs from, not a
    ``vllm_overlay`` in the working directory (another checkout)."""
    from vllm_overlay.simulate import procs

    shadow = tmp_path / "vllm_overlay"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise SystemExit('shadowed')\n")
    monkeypatch.chdir(tmp_path)
    proc = procs.start("vllm_overlay.simulate.bytes.ports", [])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "shadowed" not in out


def test_the_summary_says_one_case_in_one_configuration():
    from vllm_overlay.simulate.bytes.report import (
        BytesReport,
        ConfigItem,
        ConfigReport,
        summary_line,
    )

    item = ConfigItem("llama", "read", 1, 1, "LBNHC")
    report = BytesReport(
        lengths=[17],
        hits=[0.0],
        variants={"overlay": "series"},
        configs=[ConfigReport("overlay", item, cases=1, planned=1)],
        wall_seconds=1.0,
    )
    assert summary_line(report).startswith("1 case in 1 configuration; overlay: ")


_SESSION_FAKE = textwrap.dedent(
    """
    import json, os, sys
    print("importing vLLM (not really)", flush=True)
    for line in sys.stdin:
        item = json.loads(line)
        if item["layout"] == "crash":
            print("boom: the fake zygote fails here", flush=True)
            sys.exit(3)
        progress = {"type": "progress", "variant": "installed",
                    "layout": item["layout"], "done": 0, "total": 1}
        print(MARK + json.dumps(progress), flush=True)
        report = {"type": "bytes-config", "variant": "installed", "item": item,
                  "first_errors": [str(os.getpid()), line.strip()]}
        print(MARK + json.dumps(report), flush=True)
    """
).replace("MARK", repr(MARK))


def test_a_session_runs_plan_after_plan_in_one_zygote_until_it_ends(monkeypatch):
    """``ZygoteSession``: each plan's reports, in order and for the items
    given, from one zygote that gets each item with the plan's lengths, hits
    and WRITE wait (unless the item has its own); a zygote that ends fails
    its plan with its last lines, and the next plan starts another."""
    started: list[subprocess.Popen[str]] = []

    def fake(dirs, variant, plan, lengths, hits, ports=None, write_wait=None):
        assert plan is None  # the session hands its items over stdin
        proc = subprocess.Popen(
            [sys.executable, "-c", _SESSION_FAKE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(proc)
        return proc

    monkeypatch.setattr(run, "_start_zygote", fake)
    own = ConfigItem("b", "write", 1, 1, "LBNHC", lengths="7", write_wait=2.0)
    with run.ZygoteSession("installed") as session:
        first = session.run(_items(2), "17,65", "0,100")
        second = session.run([own], "129", "50", write_wait=5.0)
        with pytest.raises(RuntimeError, match="boom: the fake zygote fails here"):
            session.run([ConfigItem("crash", "read", 1, 1, "LBNHC")], "1", "0")
        third = session.run(_items(1), "2", "0")
    assert [r.item for r in first] == _items(2) and [r.item for r in second] == [own]

    def sent(reports: list[ConfigReport]) -> list[tuple[object, ...]]:
        got = [msgspec.json.decode(r.first_errors[1], type=ConfigItem) for r in reports]
        return [(i.lengths, i.hits, i.write_wait) for i in got]

    assert sent(first) == [("17,65", "0,100", None)] * 2
    assert sent(second) == [("7", "50", 2.0)]
    pids = {r.first_errors[0] for r in [*first, *second]}
    assert pids == {str(started[0].pid)} and session.started == 2
    assert third[0].first_errors[0] == str(started[1].pid)
    assert all(p.poll() is not None for p in started)  # none outlives the session
