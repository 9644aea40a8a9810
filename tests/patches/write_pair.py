"""A MoRIIO WRITE prefill and decode leg, each a real vLLM ``Scheduler``, and
the prefiller's real write planner.

The decode leg allocates the request's blocks and sends the prefiller its
"remote_blocks" message (captured at the ZMQ socket); the prefill leg runs
the prompt until its connector metadata carries the blocks it saves. The
prefiller's ``MoRIIOWrapper`` takes the captured message as its notify
listener does, and ``MoRIIOWriter._prepare_transfer_plan`` plans one layer's
write against a worker stand-in that records the block pairs it is asked to
copy (the offsets are vLLM's layout arithmetic, tested elsewhere): every
attention layer's pages and, with state (Mamba/KDA) groups, every state
layer's running slot. Forward passes are not modelled.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec

from tests.patches.builders import (
    make_kv_cache_config,
    make_vllm_config,
    moriio_kv_transfer_config,
)
from tests.patches.scheduler_pair_0008 import SchedulerPair, prompt
from tests.patches.vllm_unit_utils import create_scheduler

LAYER = "model.layers.0.self_attn.attn"


def build_write_scheduler(
    model_dir: Path,
    kv_role: str,
    groups: Sequence[tuple[list[str], KVCacheSpec]],
    block_size: int,
    num_blocks: int,
    disable_hma: bool = False,
) -> Scheduler:
    """A real ``Scheduler`` (prefix caching on) with MoRIIO in WRITE mode; a
    failed load is recomputed (``kv_load_failure_policy``); state groups
    cache a state per block ("align" mode), so a decoder hit holds its
    state."""
    vllm_config = make_vllm_config(
        model_dir,
        moriio_kv_transfer_config(kv_role, read_mode=False),
        block_size=block_size,
        disable_hybrid_kv_cache_manager=disable_hma,
    )
    assert vllm_config.kv_transfer_config is not None
    vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
    if any(isinstance(spec, MambaSpec) for _, spec in groups):
        vllm_config.cache_config.mamba_cache_mode = "align"
    kv_cache_config = make_kv_cache_config(groups, num_blocks)
    kv_cache_config.hash_block_size = block_size
    kv_cache_config.cache_hit_alignment_tokens = block_size
    with set_current_vllm_config(vllm_config):
        return create_scheduler(vllm_config, num_blocks, kv_cache_config)


class _Socket:
    def __init__(self, sent: list[dict[str, Any]]) -> None:
        self._sent = sent

    def send(self, data: bytes) -> None:
        self._sent.append(msgpack.loads(data))

    def close(self, linger: int = 0) -> None:
        pass


class _Worker:
    """What ``MoRIIOWriter._execute_write_task`` asks of the prefiller's
    worker."""

    def __init__(
        self, layers: dict[str, int], state_layers: set[str], wrapper: Any
    ) -> None:
        self.kv_caches = {name: torch.zeros(2, 4, 1) for name in layers}
        self.layer_to_group = dict(layers)
        self._state_layers = state_layers
        self._has_mamba = bool(state_layers)
        self.moriio_config = type("C", (), {"defer_timeout": 1.0})()
        self.moriio_wrapper = wrapper
        self.tp_rank = 0
        self.pairs: dict[str, list[tuple[int, int]]] = {}

    def _check_peer_block_size(self, layer_name: str, meta: Any) -> None:
        pass

    def _is_mamba_layer(self, layer_name: str) -> bool:
        return layer_name in self._state_layers

    def _region_session_indices(self, layer_name: str) -> list[int]:
        return [0, 1] if self._is_mamba_layer(layer_name) else [0]

    def _mamba_blocks_for_layer(
        self, layer_name: str, block_groups: Sequence[Sequence[int]]
    ) -> list[int]:
        # WRITE lists are in transfer-group order on both legs.
        return list(block_groups[self.layer_to_group[layer_name]])

    def _compute_mamba_transfer_offsets(
        self,
        layer_name: str,
        local_slots: list[int],
        remote_slots: list[int],
        remote_tp_size: int | None = None,
    ) -> tuple[list[int], list[int], list[int], int]:
        self.pairs[layer_name] = list(zip(local_slots, remote_slots, strict=True))
        return [], [], [], 0

    def get_engine_name_with_dp(self, engine_name: str, dp_rank: int) -> str:
        return f"{engine_name}_dp{dp_rank}"

    def _get_built_session(self, engine_id: str) -> tuple[list[Any], Any]:
        return [None], None

    def _compute_block_transfer_offsets(
        self,
        layer_name: str,
        local_block_ids: list[int],
        remote_block_ids: list[int],
        remote_moriio_meta: Any,
        remote_engine_id: Any = None,
    ) -> tuple[list[int], list[int], list[int]]:
        # vLLM's layout pairs the lists by index and stops at the shorter.
        self.pairs[layer_name] = list(
            zip(local_block_ids, remote_block_ids, strict=False)
        )
        return [], [], []


def record_notices(notices: list[Any], with_transfer: bool = False) -> Any:
    """A ``MoRIIOWrapper.send_notify`` that records each message's type (with
    its transfer id) instead of sending it."""

    def send_notify(
        transfer_id: str, ip: str, port: int, message_type: str | None = None, **kw: Any
    ) -> None:
        kind = message_type or ""
        notices.append((transfer_id, kind) if with_transfer else kind)

    return send_notify


class _Event:
    def synchronize(self) -> None:
        pass


@dataclass
class Write:
    """One prompt's WRITE: both legs' tables and the pages written."""

    num_prompt_tokens: int
    decode_hit_tokens: int
    prefill_table: list[int]
    decode_table: list[int]
    message: dict[str, Any]
    pairs: list[tuple[int, int]]
    """(prefill block, decode block) for every page the prefiller writes
    (the first group's)."""
    prefill_tables: list[list[int]] = field(default_factory=list)
    """Every group's prefill table once its prefill finished: the blocks it
    holds while the write is in flight (null block: 0)."""
    decode_tables: list[list[int]] = field(default_factory=list)
    group_pairs: list[list[tuple[int, int]]] = field(default_factory=list)
    """``pairs`` of every group (its first layer's)."""
    pairs_by_layer: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    """Messages the prefiller's writer sent the decoder."""
    released: bool = False
    """The prefiller's writer released its blocks (no write to wait for)."""


@dataclass
class WritePair:
    legs: SchedulerPair
    sent: list[dict[str, Any]] = field(default_factory=list)
    counter: Iterator[int] = field(default_factory=itertools.count)
    layers: dict[str, int] = field(default_factory=lambda: {LAYER: 0})
    """Each layer the prefiller writes and its transfer group."""
    state_layers: set[str] = field(default_factory=set)

    def write(
        self, tokens: list[int], decode_hit_tokens: int = 0, message: Any = None
    ) -> Write:
        """Admit ``tokens`` on the decode leg after it cached their first
        ``decode_hit_tokens``, prefill them, and plan the prefiller's write
        from the decoder's message (``message`` edits it first)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
            moriio_common,
            moriio_engine,
        )

        legs = self.legs
        i = next(self.counter)
        if decode_hit_tokens:
            warm = [*tokens[:decode_hit_tokens], *prompt(20_000 + i, 1)]
            legs._run_local(legs.decode, legs._request(f"warm-{i}", warm, None))
        request_id = f"req-{i}"
        params = {
            "transfer_id": f"t-{i}",
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": "127.0.0.1",
            "remote_handshake_port": 1,
            "remote_notify_port": 2,
            "remote_tp_size": 1,
            "remote_dp_size": 1,
        }
        decode_params = {**params, "do_remote_prefill": True}
        legs.decode.add_request(legs._request(request_id, tokens, decode_params))
        self.sent.clear()
        legs._finish_step(legs.decode, legs.decode.schedule())
        (sent,) = self.sent
        decode_tables = [
            list(g) for g in legs.decode.kv_cache_manager.get_block_ids(request_id)
        ]

        prefill_params = {**params, "do_remote_decode": True}
        legs.prefill.add_request(legs._request(request_id, tokens, prefill_params))
        saved = None
        # The connector's role is one per process (the last leg built): the
        # prefiller finds its final chunk of a split prompt only as producer.
        with _role(moriio_common, moriio_common.ROLE.PRODUCER):
            while saved is None:
                output = legs.prefill.schedule()
                saved = output.kv_connector_metadata.reqs_to_save.get(request_id)
                prefill_table = list(
                    legs.prefill.kv_cache_manager.get_block_ids(request_id)[0]
                )
                legs._finish_step(legs.prefill, output)
        prefill_tables = [
            list(g) for g in legs.prefill.kv_cache_manager.get_block_ids(request_id)
        ]

        delivered = copy.deepcopy(sent)
        if message is not None:
            message(delivered)
        notices: list[str] = []
        layers = self.layers
        if len(set(layers.values())) < len(decode_tables):
            # One layer per group where the pair names none.
            layers = {
                f"{LAYER}.{g}" if g else LAYER: g for g in range(len(decode_tables))
            }
        with _role(moriio_common, moriio_common.ROLE.PRODUCER):
            wrapper = moriio_engine.MoRIIOWrapper()
            wrapper.send_notify = record_notices(notices)  # type: ignore[method-assign]
            wrapper._handle_message(msgpack.dumps(delivered))
            worker = _Worker(layers, self.state_layers, wrapper)
            writer = moriio_engine.MoRIIOWriter(worker)  # type: ignore[arg-type]
            for layer in layers:
                task = type(
                    "Task",
                    (),
                    {
                        "request_id": request_id,
                        "transfer_id": delivered["transfer_id"],
                        "dst_engine_id": "decode",
                        "local_block_ids": [list(g) for g in saved.local_block_ids],
                        "write_start_blocks": getattr(
                            saved, "write_start_blocks", None
                        ),
                        "layer_name": layer,
                        "tp_mapping": None,
                        "remote_tp_size": 1,
                        "event": _Event(),
                        "remote_ip": "127.0.0.1",
                        "remote_notify_port": 2,
                        "multi_pod_hosts": [],
                        "remote_dp_size_local": 0,
                    },
                )()
                if not wrapper._is_transfer_terminal_locked(task.transfer_id):
                    writer._execute_write_task(task)  # type: ignore[arg-type]
            released = any(
                ack.transfer_id == delivered["transfer_id"]
                for ack in wrapper.done_req_ids
            )
        first_layers = {g: name for name, g in reversed(layers.items())}
        group_pairs = [
            worker.pairs.get(first_layers.get(g, ""), [])
            for g in range(len(decode_tables))
        ]
        return Write(
            num_prompt_tokens=len(tokens),
            decode_hit_tokens=decode_hit_tokens,
            prefill_table=prefill_table,
            decode_table=decode_tables[0],
            message=sent,
            pairs=group_pairs[0],
            prefill_tables=prefill_tables,
            decode_tables=decode_tables,
            group_pairs=group_pairs,
            pairs_by_layer=worker.pairs,
            notices=notices,
            released=released,
        )


@contextmanager
def _role(moriio_common: Any, role: Any) -> Iterator[None]:
    before = moriio_common.get_role()
    moriio_common.set_role(role)
    try:
        yield
    finally:
        moriio_common.set_role(before)


def build_write_pair(
    model_dir: Path,
    groups: Sequence[tuple[list[str], KVCacheSpec]],
    block_size: int,
    monkeypatch: pytest.MonkeyPatch,
    num_blocks: int = 1024,
    disable_hma: bool = False,
) -> WritePair:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
        moriio_connector as mc,
    )

    legs = [
        build_write_scheduler(
            model_dir, role, groups, block_size, num_blocks, disable_hma
        )
        for role in ("kv_producer", "kv_consumer")
    ]
    pair = WritePair(
        SchedulerPair(legs[0], legs[1], block_size),
        layers={name: g for g, (names, _) in enumerate(groups) for name in names},
        state_layers={
            name
            for names, spec in groups
            if isinstance(spec, MambaSpec)
            for name in names
        },
    )
    monkeypatch.setattr(mc, "make_zmq_socket", lambda **kw: _Socket(pair.sent))
    return pair
