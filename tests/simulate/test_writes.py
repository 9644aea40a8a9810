"""WRITE in the scheduler simulator (``simulate/writes.py`` and the WRITE
case of ``drive.Pair``), on real schedulers with the installed (overlaid)
moriio files: the decoder allocates and notifies, the prefiller prefills and
writes, the decoder is judged on what it holds for its last prompt token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_overlay.simulate import drive
from vllm_overlay.simulate.writes import (
    Notified,
    WriteRefused,
    leg_params,
    notified_lists,
    parse_modes,
    row_key,
    write_done_fails,
    write_done_message,
    write_pairs,
)

LENGTHS = (17, 529, 545)
HITS = (0.0, 0.5, 1.0)


@pytest.fixture(scope="module")
def llama_write():
    from vllm_overlay.simulate.layouts import expand

    return drive.Pair(expand(["llama"])[0], 1024, port=47400, mode="write")


@pytest.fixture(scope="module")
def kimi_write():
    from vllm_overlay.simulate.layouts import expand

    return drive.Pair(expand(["kimi"])[0], 1024, port=47600, mode="write")


def _right(pair: drive.Pair, n: int, hit: float) -> None:
    r = pair.run_case(n, hit)
    assert r.error is None, (n, hit, r.error)
    assert not r.wrong, (n, hit, r.wrong_groups)
    assert r.null_reads == 0 and r.unread == 0
    # The overlay writes exactly the pages the decoder lacked.
    assert r.pages_read == r.min_pages, (n, hit, r.pages_read, r.min_pages)
    assert r.extra_reads == 0 and r.duplicate_reads == 0


@pytest.mark.parametrize("hit", HITS)
def test_llama_write_is_right_and_moves_only_the_missing_pages(llama_write, hit):
    for n in LENGTHS:
        _right(llama_write, n, hit)
    # A prefix hit leaves fewer pages to write than none.
    assert llama_write.run_case(529, 0.5).min_pages < 33


@pytest.mark.parametrize("hit", HITS)
def test_kimi_write_is_right_at_every_length(kimi_write, hit):
    """Kimi's align-mode prefill of 529 tokens runs in two chunks: the
    prefiller's connector saves on the last one only when it runs in the
    producer's role (each leg steps in its own)."""
    for n in LENGTHS:
        _right(kimi_write, n, hit)


def test_the_write_of_a_page_the_decoder_holds_is_counted(llama_write, monkeypatch):
    """A prefiller that ignores ``num_held_blocks`` (the base's worker) also
    writes the decoder's cached pages: right KV, more than the minimum."""
    plain = llama_write.run_case(529, 0.5)
    real = drive.write_pairs

    def every_page(writer, has_mamba, states, save, start, notified):
        whole = Notified(notified.block_lists, None)
        return real(writer, has_mamba, states, save, start, whole)

    monkeypatch.setattr(drive, "write_pairs", every_page)
    extra = llama_write.run_case(529, 0.5)
    assert plain.error is None and extra.error is None
    assert not extra.wrong
    assert extra.min_pages == plain.min_pages
    assert extra.pages_read == plain.pages_read + extra.extra_reads
    assert extra.extra_reads == 16


def test_a_page_written_off_by_one_is_wrong_kv(llama_write, monkeypatch):
    real = drive.write_pairs

    def shifted(*args):
        pairs = real(*args)
        return [
            [(src, dst) for (src, _), (_, dst) in zip(p, p[1:] + p[:1], strict=True)]
            for p in pairs
        ]

    monkeypatch.setattr(drive, "write_pairs", shifted)
    r = llama_write.run_case(545, 0.0)
    assert r.error is None
    assert r.wrong and r.wrong_groups == [0]


def test_a_page_left_unwritten_is_wrong_kv(kimi_write, monkeypatch):
    real = drive.write_pairs

    def drop_last_attention_page(*args):
        pairs = real(*args)
        return [p[:-1] if len(p) > 1 else p for p in pairs]

    monkeypatch.setattr(drive, "write_pairs", drop_last_attention_page)
    r = kimi_write.run_case(545, 0.0)
    assert r.error is None
    assert r.wrong and r.unread == 1


def test_a_layout_the_connector_refuses_in_write_is_refused_at_start(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector,
    )

    from vllm_overlay.simulate.worker import run_layout

    # The connector takes EAGLE drafters only beside window groups, as it did
    # before it took MTP ones: Step5-MTP is refused at start.
    monkeypatch.setattr(
        moriio_connector,
        "_WINDOW_WRITE_SPECULATIVE_METHODS",
        ("eagle", "eagle3"),
        raising=False,
    )
    report = run_layout("overlay", "step5-mtp", [17], [0.0], port=47800, mode="write")
    assert report.mode == "write"
    assert report.refused_by == "connector"
    assert "MoRIIO WRITE" in (report.refused_at_start or "")
    assert report.cases == 0


def test_write_pairs_follow_the_build_of_the_prefiller():
    notified = Notified([[10, 11, 12, 13]], [2])
    save = [[1, 2, 3, 4]]

    class Overlaid:
        @staticmethod
        def _write_pages(task, info, group):
            first = info.num_held_blocks[group] if info.num_held_blocks else 0
            return task.local_block_ids[group][first:], info.block_ids[group][first:]

    # A build whose writer knows the held pages writes the others only.
    assert write_pairs(Overlaid, False, [False], save, None, notified) == [
        [(3, 12), (4, 13)]
    ]
    # The base's writer pairs every page from the first.
    base = SimpleNamespace()
    assert write_pairs(base, False, [False], save, None, notified) == [
        [(1, 10), (2, 11), (3, 12), (4, 13)]
    ]
    # A state group writes its one running slot; more is refused.
    assert write_pairs(base, True, [True], [[7]], None, Notified([[9]], None)) == [
        [(7, 9)]
    ]
    with pytest.raises(WriteRefused, match="one running-state slot"):
        write_pairs(base, True, [True], [[7, 8]], None, Notified([[9]], None))


def test_the_notified_lists_and_the_legs_params():
    assert notified_lists([3, 4]) == [[3, 4]]
    assert notified_lists([[3], [4, 5]]) == [[3], [4, 5]]
    with pytest.raises(WriteRefused, match="cannot be empty"):
        notified_lists([])
    d = leg_params("t1", 41000, 2, decode=True)
    p = leg_params("t1", 41100, 1, decode=False)
    assert d["do_remote_prefill"] and not d["do_remote_decode"]
    assert p["do_remote_decode"] and not p["do_remote_prefill"]
    assert (d["remote_notify_port"], d["remote_tp_size"]) == (41001, 2)
    assert d["remote_block_ids"] is None and p["remote_engine_id"] is None


def test_modes_parse_like_simulate_bytes():
    assert parse_modes("read,write") == ["read", "write"]
    assert parse_modes(" write, write ") == ["write"]
    for bad in ("push", "", "read,pull"):
        with pytest.raises(ValueError):
            parse_modes(bad)
    assert row_key("llama", "read") == "llama"
    assert row_key("llama/dcp2", "write") == "llama/dcp2 write"


def test_a_write_the_prefillers_writer_refuses_is_a_fallback(llama_write, monkeypatch):
    """A decoder page that is the null block: the overlay's writer
    (``_unwritable_pages``) writes nothing and sends write_failed; the
    decoder's scheduler gets the request in failed_recving, recomputes it
    (kv_load_failure_policy "recompute") with the right KV, and the case is
    a fallback, not a crash."""
    real = drive.notified_lists
    null = llama_write.d_store.null_block_id

    def with_null_page(raw):
        lists = real(raw)
        return [[null, *lists[0][1:]], *lists[1:]]

    monkeypatch.setattr(drive, "notified_lists", with_null_page)
    r = llama_write.run_case(545, 0.0)
    assert r.error is None, r.error
    assert r.fallback and not r.wrong
    assert r.pages_read == 0
    monkeypatch.undo()
    _right(llama_write, 545, 0.0)


def test_a_refusal_without_write_failed_is_an_error_case(llama_write, monkeypatch):
    """A refusal the prefiller meets outside its writer's check (here its
    worker's MoRIIOError on an empty block list) sends the decoder nothing:
    the case is an error (a crash in the verdict unless listed), not a
    fallback, and the next case runs on rebuilt legs."""
    monkeypatch.setattr(drive, "notified_lists", lambda raw: notified_lists([]))
    r = llama_write.run_case(545, 0.0)
    assert r.error is not None and r.error.startswith("WriteRefused: ")
    assert not r.fallback
    monkeypatch.undo()
    _right(llama_write, 545, 0.0)


def test_an_unstated_write_done_is_a_failed_receive_on_a_window_decoder():
    """The decoder build's real wrapper judges the prefiller build's
    write_done: without the statement a window decoder reports it failed;
    with it, or on a decoder without a window group, it is received."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_common,
        moriio_engine,
    )

    wrapper = moriio_engine.MoRIIOWrapper
    stated = write_done_message(moriio_engine.MoRIIOWriter, "t1")
    unstated = write_done_message(None, "t2")
    assert unstated == {"type": "write_done", "transfer_id": "t2"}
    moriio_common.set_role(moriio_common.ROLE.CONSUMER)
    assert write_done_fails(wrapper, True, unstated)
    assert not write_done_fails(wrapper, True, stated)
    assert not write_done_fails(wrapper, False, unstated)
