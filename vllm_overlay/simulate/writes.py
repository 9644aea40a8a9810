"""WRITE mode in the scheduler simulator: the proxy's parameters of each leg
and the pages the prefiller's workers write into the decoder's.

The decoder's connector sends the prefiller its block lists
(``send_notify_block``: ``block_notify_list`` and, in builds that state it,
``num_held_blocks``); the prefiller's scheduler puts the pages it saves in
its ``ReqMeta`` (``reqs_to_save``: ``local_block_ids`` and, in builds that
have it, ``write_start_blocks``). ``write_pairs`` pairs them as the
prefiller's build's ``MoRIIOWriter`` does (``_write_pages`` where the build
has it, every page from the first otherwise; ``_unwritable_pages`` where the
build has it), each transfer group's layers on the list of their transfer
group index (``transfer_group_index_by_layer``), a state group's running
slot on its own list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Final, Literal

Mode = Literal["read", "write"]
READ: Final = "read"
WRITE: Final = "write"
MODES: tuple[Mode, ...] = (READ, WRITE)
"""The connector's modes, as ``simulate-bytes --modes`` names them."""


class WriteRefused(RuntimeError):
    """The prefiller's workers write nothing of the request (a page they
    cannot write, a state group without one running slot)."""


class WriteFailed(WriteRefused):
    """The prefiller's writer refused the pages it pairs
    (``_unwritable_pages``): it writes nothing and sends the decoder
    ``write_failed``, whose workers report the request in
    ``failed_recving``."""


@dataclass(frozen=True)
class Notified:
    """What the decoder's connector sent the prefiller for one transfer."""

    block_lists: list[list[int]]
    num_held_blocks: list[int] | None


def row_key(layout: str, mode: str) -> str:
    """How a sweep names one layout's row in a mode: the layout for READ
    (as before WRITE ran), ``layout write`` for WRITE."""
    return layout if mode == READ else f"{layout} {mode}"


def parse_modes(text: str) -> list[Mode]:
    """``--modes``: a comma list of read and write, each once, in the order
    given; a bad value is a ValueError saying why."""
    modes: list[Mode] = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        mode = next((m for m in MODES if m == part), None)
        if mode is None:
            raise ValueError(f"unknown mode {part!r}; choose from {list(MODES)}")
        if mode not in modes:
            modes.append(mode)
    if not modes:
        raise ValueError("no mode given (read, write or read,write)")
    return modes


def leg_params(
    transfer_id: str, peer_port: int, peer_tp: int, decode: bool
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a WRITE proxy gives one leg up front: the
    peer's address (``peer_port``: its handshake port; notify is one above)
    and no block ids. ``decode``: the decoder's (``do_remote_prefill``)."""
    return {
        "do_remote_prefill": decode,
        "do_remote_decode": not decode,
        "transfer_id": transfer_id,
        "remote_host": "127.0.0.1",
        "remote_handshake_port": peer_port,
        "remote_notify_port": peer_port + 1,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_tp_size": peer_tp,
        "remote_dp_size": 1,
    }


def notified_lists(block_notify_list: Any) -> list[list[int]]:
    """The decoder's lists as the prefiller's worker reads them: one list
    when it sent the block ids of one group."""
    lists = list(block_notify_list or [])
    if not lists:
        raise WriteRefused("block_notify_list cannot be empty (MoRIIOError)")
    if isinstance(lists[0], int):
        return [[int(b) for b in lists]]
    return [[int(b) for b in group] for group in lists]


def _held(notified: Notified) -> list[int] | None:
    """``num_held_blocks`` as the worker keeps it: one count per list within
    it, else ignored (every page written)."""
    held = notified.num_held_blocks
    lists = notified.block_lists
    if held is None:
        return None
    if (
        isinstance(held, list)
        and len(held) == len(lists)
        and all(
            isinstance(h, int) and 0 <= h <= len(g)
            for h, g in zip(held, lists, strict=True)
        )
    ):
        return held
    return None


def write_pairs(
    writer: type | None,
    has_mamba: bool,
    state_lists: Sequence[bool],
    save_lists: Sequence[Sequence[int]],
    write_start_blocks: Sequence[int] | None,
    notified: Notified,
) -> list[list[tuple[int, int]]]:
    """(prefiller page, decoder page) per list the workers write, in the
    order of ``save_lists``. ``writer``: the prefiller build's
    ``MoRIIOWriter`` (its ``_write_pages`` and ``_unwritable_pages`` when it
    has them); ``state_lists``: which lists are a state group's (one running
    slot each). Raises ``WriteRefused`` where the workers write nothing."""
    held = _held(notified)
    local = [list(x) for x in save_lists]
    task = SimpleNamespace(local_block_ids=local, write_start_blocks=write_start_blocks)
    info = SimpleNamespace(block_ids=notified.block_lists, num_held_blocks=held)
    write_pages = getattr(writer, "_write_pages", None)
    unwritable = getattr(writer, "_unwritable_pages", None)
    if unwritable is not None and write_pages is not None:
        worker = SimpleNamespace(
            _has_mamba=has_mamba,
            _mamba_transfer_group_ids=frozenset(
                t for t, is_state in enumerate(state_lists) if is_state
            ),
        )
        fake = SimpleNamespace(worker=worker, _write_pages=write_pages)
        if reason := unwritable(fake, task, info):
            raise WriteFailed(f"the prefiller writes nothing: {reason}")
    out: list[list[tuple[int, int]]] = []
    for t, is_state in enumerate(state_lists):
        if t >= len(notified.block_lists) or t >= len(local):
            raise WriteRefused(
                f"list {t} has no block group in the transfer payload (MoRIIOError)"
            )
        if is_state:
            src, dst = local[t], notified.block_lists[t]
            if len(src) != 1 or len(dst) != 1:
                raise WriteRefused(
                    "Hybrid WRITE requires one running-state slot per Mamba group "
                    f"(prefiller {src}, decoder {dst})"
                )
            out.append([(src[0], dst[0])])
            continue
        if write_pages is not None:
            src, dst = write_pages(task, info, t)
        else:
            src, dst = local[t], notified.block_lists[t]
        if has_mamba:
            dst = dst[: len(src)]
        out.append(list(zip(src, dst, strict=False)))
    return out


def write_done_message(writer: type | None, transfer_id: str) -> dict[str, Any]:
    """The ``write_done`` notify the prefiller's build sends one decoder rank
    once its one writer wrote the transfer: ``write_done_fields`` of its
    engine module where the build has it, the transfer id alone otherwise."""
    globals_ = getattr(getattr(writer, "__init__", None), "__globals__", {})
    fields = globals_.get("write_done_fields")
    extra: dict[str, Any] = dict(fields(1)) if fields is not None else {}
    return {"type": "write_done", "transfer_id": transfer_id, **extra}


def write_done_fails(
    wrapper_type: type, requires_stated_writes: bool, message: dict[str, Any]
) -> bool:
    """Whether the decoder build's real ``MoRIIOWrapper`` reports the
    transfer of ``message`` failed rather than received
    (``requires_stated_writes``: what its worker sets, where the build has
    it). The caller holds the decoder's role."""
    import msgpack

    wrapper = wrapper_type()
    if hasattr(wrapper, "requires_stated_writes"):
        wrapper.requires_stated_writes = requires_stated_writes
    wrapper._handle_message(msgpack.dumps(message))
    failed = wrapper.pop_failed_write_req_ids()
    received = wrapper.pop_finished_write_req_ids()
    if message["transfer_id"] not in failed | received:
        raise WriteRefused("the decoder took the write_done as neither done nor failed")
    return message["transfer_id"] in failed
