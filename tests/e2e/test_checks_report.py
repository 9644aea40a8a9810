"""Comparison and report logic on recorded outputs, mismatches included."""

from __future__ import annotations

from pathlib import Path

from vllm_overlay.e2e.checks import (
    NO_SERIES,
    Exchange,
    Transfer,
    accuracy_section,
    compare,
    first_difference,
    front_end_section,
    image_series,
    launch_section,
    needle_section,
    overlay_section,
    prefix_section,
    repeat_section,
    sweep_section,
    transfer_section,
)
from vllm_overlay.e2e.client import Completion, parse_completion, parse_counters
from vllm_overlay.e2e.launch import ContainerState
from vllm_overlay.e2e.report import Report, markdown, read_report, write_report


def answer(tokens: list[int], prompt_tokens: int, text: str = "") -> Completion:
    return Completion(tokens, text or " ".join(map(str, tokens)), prompt_tokens)


def ex(
    length: int,
    pd: list[int],
    direct: list[int],
    loaded: float = 0.0,
    **kw: object,
) -> Exchange:
    return Exchange(
        f"kv-{length}", "kv", length, "",
        answer(pd, kw.pop("pd_prompt", length)),  # type: ignore[arg-type]
        answer(direct, length),
        Transfer(loaded, 0.0, int(loaded) * 10),
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) == -1
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_sweep_passes_only_when_every_answer_matches() -> None:
    good = [ex(n, [5, 6, 7], [5, 6, 7], n - 1) for n in (251, 377, 384)]
    assert sweep_section(good).status == "pass"
    bad = [*good, ex(447, [5, 6, 7], [5, 8, 7], 446)]
    section = sweep_section(bad)
    assert section.status == "fail"
    failed = [c for c in section.cases if c.status == "fail"]
    assert [(c.length, c.first_mismatch) for c in failed] == [(447, 1)]
    assert section.summary["failed_lengths"] == "447"


def test_a_prompt_of_the_wrong_length_fails() -> None:
    case = compare(ex(636, [1], [1], pd_prompt=635))
    assert case.status == "fail"
    assert "server saw 635 prompt tokens, sent 636" in case.detail


def test_errors_and_empty_answers_fail() -> None:
    e = ex(832, [1], [1])
    e.pd = Completion([], "", 0, error="HTTP 500: boom")
    assert compare(e).status == "fail"
    e2 = ex(895, [], [])
    assert compare(e2).detail == "pd: empty answer"


def test_needle_recall_and_skips() -> None:
    found = Exchange(
        "needle-2000", "needle", 2600, "1234567",
        answer([1, 2], 2600, " 1234567."), answer([1, 2], 2600, " 1234567."),
    )  # fmt: skip
    lost = Exchange(
        "needle-8000", "needle", 10400, "7654321",
        answer([3], 10400, " 42"), answer([3], 10400, " 42"),
    )  # fmt: skip
    skipped = Exchange(
        "needle-96000", "needle", 130000, "1",
        Completion([], "", 0), Completion([], "", 0), skipped="too long",
    )  # fmt: skip
    # Both paths miss the 8000-word needle alike: a model limit, not a P/D bug.
    assert needle_section([found, lost, skipped]).status == "pass"
    pd_lost = Exchange(
        "needle-32000", "needle", 41000, "5555555",
        answer([9], 41000, " 1"), answer([8], 41000, " 5555555"),
    )  # fmt: skip
    section = needle_section([found, pd_lost, skipped])
    assert section.status == "fail"
    assert [c.status for c in section.cases] == ["pass", "fail", "skip"]
    assert section.summary == {"sent": 2, "pd_recalled": 1}


def test_repeat_must_match_and_shrink() -> None:
    first, second = ex(2000, [4, 4], [4, 4], 1999.0), ex(2000, [4, 4], [4, 4], 0.0)
    assert repeat_section(first, second).status == "pass"
    same = ex(2000, [4, 4], [4, 4], 1999.0)
    assert repeat_section(first, same).cases[-1].status == "fail"
    differs = ex(2000, [4, 5], [4, 5], 0.0)
    assert repeat_section(first, differs).cases[1].detail == (
        "answer differs from the first"
    )
    no_stats = ex(2000, [4, 4], [4, 4])
    no_stats.transfer = None
    assert repeat_section(first, no_stats).status == "fail"


def test_transfer_section_totals() -> None:
    section = transfer_section([ex(16, [1], [1], 15.0), ex(32, [1], [1], 31.0)])
    assert section.status == "pass"
    assert section.summary == {
        "requests": 2, "tokens_total": 46.0, "bytes_total": 460,
        "nic_bytes_total": -1,  # no NIC counters read
    }  # fmt: skip
    for e in (read := [ex(16, [1], [1], 15.0), ex(32, [1], [1], 31.0)]):
        assert e.transfer is not None
        e.transfer.nic_bytes = e.length * 4
    assert transfer_section(read).summary["nic_bytes_total"] == 192


def test_the_base_banner_is_what_an_ab_base_must_show() -> None:
    base = (
        "vllm-moriio-overlay: no overlay manifest at /x/.overlay-manifest.json; "
        "the MoRIIO files are vLLM 0.34.0's own (base) or unknown"
    )
    line = "vllm-moriio-overlay: series 0123abcd4567 (0001-a) on vLLM 0.34.0"
    ok = overlay_section({"prefill": base, "decode": base}, NO_SERIES)
    assert ok.status == "pass" and ok.summary["series"] == NO_SERIES
    mixed = overlay_section({"prefill": base, "decode": line}, NO_SERIES)
    assert mixed.status == "fail"
    assert mixed.cases[0].detail == f"{line}; expected the base"


def test_overlay_banner_per_leg() -> None:
    line = "vllm-moriio-overlay: series 0123abcd4567 (0001-a, 0002-b) on vLLM 0.33.0"
    logs = {"prefill": f"INFO x\n{line}\n", "decode": f"{line}\n"}
    assert overlay_section(logs, "0123abcd4567").status == "pass"
    assert overlay_section(logs, "ffffffffffff").status == "fail"
    other = line.replace("0123abcd4567", "999999999999")
    assert overlay_section({"prefill": line, "decode": other}).status == "fail"
    assert overlay_section({"prefill": line, "decode": "no banner"}).status == "fail"


def test_report_json_and_markdown(tmp_path: Path) -> None:
    sections = [
        sweep_section([ex(251, [1, 2], [1, 2], 250), ex(447, [1, 2], [1, 3], 446)])
    ]
    report = Report("img:tag", "0123abcd4567", {"name": "pair"}, sections)
    assert not report.ok
    js, md = write_report(report, tmp_path)
    assert read_report(js) == report
    head = js.read_text().splitlines()[1:4]
    assert [h.split(":")[0].strip() for h in head] == [
        '"image"',
        '"series_id"',
        '"config"',
    ]
    text = md.read_text()
    assert text.startswith("# MoRIIO E2E: FAIL\n")
    assert "- image: `img:tag`" in text and "- series: `0123abcd4567`" in text
    assert "| kv-447 | 447 | fail | first mismatch at output token 1:" in text
    assert markdown(Report("i", "s", {}, [sweep_section([ex(16, [1], [1], 15)])]))
    passing = Report("i", "s", {}, [sweep_section([ex(16, [1], [1], 15)])])
    assert passing.ok
    assert not Report("i", "s", {}, [], error="Terminated: signal 15").ok


def test_parse_completion_and_counters() -> None:
    data = {
        "choices": [{"text": " 42", "token_ids": [4, 2], "finish_reason": "length"}],
        "usage": {"prompt_tokens": 7},
    }
    assert parse_completion(data) == Completion([4, 2], " 42", 7, "length")
    assert parse_completion({"choices": [{"text": "x"}]}).error
    assert parse_completion({}).error.startswith("malformed answer")
    text = (
        "# HELP vllm:external_prefix_cache_hits_total x\n"
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 30.0\n'
        'vllm:external_prefix_cache_hits_total{engine="1",model_name="m"} 12.0\n'
        'vllm:external_prefix_cache_hits_created{engine="0"} 1.7e9\n'
        'vllm:prefix_cache_hits_total{engine="0"} 5\n'
    )
    got = parse_counters(
        text, ("vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits")
    )
    assert got == {
        "vllm:external_prefix_cache_hits": 42.0,
        "vllm:prefix_cache_hits": 5.0,
    }


def test_repeat_over_several_decoders_judges_the_last() -> None:
    # Two decoders, round robin: the first repeat lands on the other decoder
    # (no hit), the second on the first one again.
    first, miss, hit = (
        ex(2000, [4, 4], [4, 4], 1999.0),
        ex(2000, [4, 4], [4, 4], 1999.0),
        ex(2000, [4, 4], [4, 4], 0.0),
    )
    section = repeat_section(first, miss, hit)
    assert [c.id for c in section.cases] == [
        "first", "repeat 1", "repeat 2", "transfer shrinks",
    ]  # fmt: skip
    assert section.status == "pass"


def test_sweep_splits_predicted_and_unexpected_failures() -> None:
    exchanges = [
        ex(184, [1, 2], [1, 3], 183),  # predicted (lookahead shift), failed
        ex(190, [1, 2], [1, 2], 189),  # predicted, passed
        ex(200, [1, 2], [1, 3], 199),  # not predicted, failed
    ]
    predicted = {184: ("lookahead-shift",), 190: ("lookahead-shift",)}
    section = sweep_section(exchanges, predicted)
    assert section.summary["failed_lengths"] == "184, 200"
    assert section.summary["unexpected_failures"] == "200"
    assert section.summary["predicted_but_passed"] == "190"
    assert section.cases[0].expected == "expected to fail: lookahead-shift"
    assert section.cases[2].expected == ""


def test_prefix_pairs_must_match_and_load_less() -> None:
    first, second = ex(4096, [7], [7], 4095.0), ex(4096, [8], [8], 2047.0)
    section = prefix_section([(first, second)], ["decoder hit 2048"])
    assert section.status == "pass"
    assert (
        section.cases[-1].detail
        == "4095 -> 2047 tokens (20470 bytes); decoder hit 2048"
    )
    no_hit = ex(4096, [8], [8], 4095.0)
    assert prefix_section([(first, no_hit)]).status == "fail"
    wrong = ex(4096, [8], [9], 2047.0)
    assert prefix_section([(first, wrong)]).status == "fail"


def test_accuracy_gate_threshold_and_drop() -> None:
    assert accuracy_section(0.95, 0.96, 50, 0.9, 0.05).status == "pass"
    low = accuracy_section(0.85, 0.86, 50, 0.9, 0.05)
    assert [c.status for c in low.cases] == ["fail", "pass"]
    drop = accuracy_section(0.91, 0.99, 50, 0.9, 0.05)
    assert [c.status for c in drop.cases] == ["pass", "fail"]
    assert accuracy_section(0.95, 0.95, 50, 0.9, 0.05, errors=2).status == "fail"


def test_front_end_section() -> None:
    ok = front_end_section("toy-proxy", "auto", "minus-one", 1)
    assert ok.status == "pass"
    assert ok.cases[0].detail == "toy-proxy: decoder gets max_tokens - 1"
    wrong = front_end_section("toy-proxy", "exact", "minus-one", 1)
    assert wrong.status == "fail"
    assert wrong.cases[0].detail.startswith("configured exact, measured minus-one")


def test_launch_section_quotes_the_last_lines() -> None:
    state = ContainerState(
        "decode-0", "mi350x-b", "exited", 137, True, ["loading", "Killed"]
    )
    section = launch_section([state], "ContainerExited: ...")
    assert section.status == "fail"
    assert section.cases[0].detail == (
        "decode-0 @ mi350x-b exited (exit 137, OOM-killed):\nloading\nKilled"
    )
    assert launch_section([], "").status == "pass"
    assert launch_section([], "Terminated: signal 15").status == "fail"


def test_image_series_from_the_banner() -> None:
    line = "vllm-moriio-overlay: series 0123abcd4567 (0001-a, 0002-b) on vLLM 0.33.0"
    assert image_series({"prefill-0": line}) == ["0001-a", "0002-b"]
    base = (
        "vllm-moriio-overlay: no overlay manifest at /x; the MoRIIO files are "
        "vLLM 0.33.0's own (base) or unknown"
    )
    assert image_series({"prefill-0": base}) == []
    assert image_series({"prefill-0": "nothing"}) is None
