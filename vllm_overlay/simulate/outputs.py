"""The model runner's output the simulator hands vLLM's scheduler.

vLLM 0.33.0's ``ModelRunnerOutput`` takes ``req_id_to_index`` (each request's
row); 0.34.0's does not (the rows follow ``req_ids``). The field is filled in
when the installed class takes it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _takes_row_map(cls: type) -> bool:
    # Once per class: the simulator builds an output every scheduler step.
    return "req_id_to_index" in inspect.signature(cls).parameters


def model_runner_output(req_ids: list[str], **fields: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` for ``req_ids`` (in row order) and
    ``fields``, with ``req_id_to_index`` when the installed vLLM takes it."""
    from vllm.v1.outputs import ModelRunnerOutput

    if _takes_row_map(ModelRunnerOutput):
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)
