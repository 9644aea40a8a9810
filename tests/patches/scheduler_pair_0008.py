"""A MoRIIO READ prefill and decode leg, each a real vLLM ``Scheduler`` (patch
0008).

Each leg owns a real KV cache manager; the scheduler builds the real MoRIIO
connector (READ mode opens no socket on the scheduler side). A prompt runs
on the prefill leg until its ``kv_transfer_params`` come back, then on the
decode leg, whose first step carries the READ in its connector metadata.
Forward passes are not modelled: a step only reports one sampled token for
each request whose prompt is complete.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.config import set_current_vllm_config
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from tests.patches.builders import (
    make_kv_cache_config,
    make_vllm_config,
    moriio_kv_transfer_config,
)
from tests.patches.vllm_unit_utils import create_scheduler

_SAMPLED_TOKEN = 7


def build_scheduler(
    model_dir: Path,
    kv_role: str,
    groups: Sequence[tuple[list[str], KVCacheSpec]],
    block_size: int,
    num_blocks: int,
) -> Scheduler:
    """A real ``Scheduler`` over ``groups`` (one block size, prefix caching on)
    with the MoRIIO connector in READ mode."""
    vllm_config = make_vllm_config(
        model_dir, moriio_kv_transfer_config(kv_role), block_size=block_size
    )
    kv_cache_config = make_kv_cache_config(groups, num_blocks)
    kv_cache_config.hash_block_size = block_size
    kv_cache_config.cache_hit_alignment_tokens = block_size
    with set_current_vllm_config(vllm_config):
        return create_scheduler(vllm_config, num_blocks, kv_cache_config)


_SEED_STRIDE = 50_021


def model_runner_output(req_ids: list[str], **fields: Any) -> ModelRunnerOutput:
    """The runner's output for ``req_ids`` in row order; ``req_id_to_index``
    only where ``ModelRunnerOutput`` still takes it (vLLM 0.33.0 did)."""
    if "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


def prompt(seed: int, num_tokens: int) -> list[int]:
    """Tokens no other seed shares (its first one already differs), so only a
    deliberate prefix is a hit. Token ids stay below 2**31: vLLM keeps a
    request's tokens as int32."""
    assert num_tokens < _SEED_STRIDE
    tokens = [seed * _SEED_STRIDE + i for i in range(num_tokens)]
    assert tokens[-1] < 2**31
    return tokens


@dataclass
class Read:
    """What the decoder's first step READs, with both legs' tables."""

    num_prompt_tokens: int
    num_prefilled_tokens: int
    """Tokens the prefill leg computed."""
    prefill_tables: list[list[int]]
    """The prefill request's tables when it finished (null block: 0)."""
    decode_tables: list[list[int]]
    decode_hit_tokens: int
    """Prompt tokens the decoder had in its prefix cache (N-1-E)."""
    local_block_ids: list[list[int]]
    remote_block_ids: list[list[int]]


@dataclass
class SchedulerPair:
    prefill: Scheduler
    decode: Scheduler
    block_size: int
    counter: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(self.block_size, sha256)
        self._external: dict[str, int] = {}
        connector = self.decode.connector
        assert connector is not None
        update = connector.update_state_after_alloc

        def record(request: Request, blocks: Any, num_external_tokens: int) -> Any:
            self._external[request.request_id] = num_external_tokens
            return update(request, blocks, num_external_tokens)

        connector.update_state_after_alloc = record  # type: ignore[method-assign]

    def _request(self, request_id: str, tokens: list[int], params: Any) -> Request:
        extra = {"kv_transfer_params": params} if params is not None else None
        return Request(
            request_id,
            list(tokens),
            SamplingParams(max_tokens=1, ignore_eos=True, extra_args=extra),
            None,
            block_hasher=self._hasher,
        )

    @staticmethod
    def _step(
        scheduler: Scheduler, finished_sending: set[str] | None = None
    ) -> list[Any]:
        return SchedulerPair._finish_step(
            scheduler, scheduler.schedule(), finished_sending
        )

    @staticmethod
    def _finish_step(
        scheduler: Scheduler, output: Any, finished_sending: set[str] | None = None
    ) -> list[Any]:
        """Report the step as run: one token for every complete prompt."""
        req_ids = list(output.num_scheduled_tokens)
        sampled = [
            [_SAMPLED_TOKEN]
            if scheduler.requests[r].num_computed_tokens
            >= scheduler.requests[r].num_tokens
            else []
            for r in req_ids
        ]
        result = scheduler.update_from_output(
            output,
            model_runner_output(
                req_ids,
                sampled_token_ids=sampled,
                kv_connector_output=KVConnectorOutput(finished_sending=finished_sending)
                if finished_sending
                else None,
            ),
        )
        return [o for eco in result.values() for o in eco.outputs]

    def prefill_payload(self, request_id: str, tokens: list[int]) -> Any:
        """Run ``tokens`` on the prefill leg; the payload its connector hands
        the decoder (``do_remote_prefill`` set, as a proxy forwards it)."""
        request = self._request(
            request_id, tokens, {"do_remote_decode": True, "transfer_id": request_id}
        )
        self.prefill.add_request(request)
        while True:
            for output in self._step(self.prefill):
                if output.kv_transfer_params:
                    params = copy.deepcopy(output.kv_transfer_params)
                    params["do_remote_prefill"] = True
                    return params

    def _run_local(self, scheduler: Scheduler, request: Request) -> None:
        scheduler.add_request(request)
        while request.request_id in scheduler.requests:
            self._step(scheduler)

    def read(self, tokens: list[int], decode_hit_tokens: int = 0) -> Read:
        """Prefill ``tokens``, then admit them on the decode leg after it
        cached their first ``decode_hit_tokens`` (a local prefix hit)."""
        i = next(self.counter)
        if decode_hit_tokens:
            warm = [*tokens[:decode_hit_tokens], *prompt(10_000 + i, 1)]
            self._run_local(self.decode, self._request(f"warm-{i}", warm, None))
        request_id = f"req-{i}"
        prefill_request = self._request(
            request_id, tokens, {"do_remote_decode": True, "transfer_id": f"t-{i}"}
        )
        self.prefill.add_request(prefill_request)
        params = None
        while params is None:
            outputs = self._step(self.prefill)
            params = next(
                (o.kv_transfer_params for o in outputs if o.kv_transfer_params), None
            )
        prefill_tables = [
            list(group)
            for group in self.prefill.kv_cache_manager.get_block_ids(request_id)
        ]
        num_prefilled_tokens = prefill_request.num_computed_tokens

        decode_params = copy.deepcopy(params)
        decode_params["do_remote_prefill"] = True
        self.decode.add_request(self._request(request_id, tokens, decode_params))
        output = self.decode.schedule()
        decode_tables = [
            list(group)
            for group in self.decode.kv_cache_manager.get_block_ids(request_id)
        ]
        meta = output.kv_connector_metadata.reqs_to_recv[request_id]
        self._finish_step(self.decode, output)
        while request_id in self.decode.requests:
            self._step(self.decode)
        self._step(self.prefill, finished_sending={request_id})
        assert request_id not in self.prefill.requests
        return Read(
            num_prompt_tokens=len(tokens),
            num_prefilled_tokens=num_prefilled_tokens,
            prefill_tables=prefill_tables,
            decode_tables=decode_tables,
            decode_hit_tokens=len(tokens) - 1 - self._external.pop(request_id),
            local_block_ids=[list(g) for g in meta.local_block_ids],
            remote_block_ids=[list(g) for g in meta.remote_block_ids],
        )


def build_scheduler_pair(
    model_dir: Path,
    groups: Sequence[tuple[list[str], KVCacheSpec]],
    block_size: int,
    num_blocks: int = 2048,
) -> SchedulerPair:
    legs = [
        build_scheduler(model_dir, role, groups, block_size, num_blocks)
        for role in ("kv_producer", "kv_consumer")
    ]
    return SchedulerPair(legs[0], legs[1], block_size)
