"""The model runner's output the simulator builds: ``req_id_to_index`` only
where the installed vLLM's ``ModelRunnerOutput`` takes it (0.33.0 does,
0.34.0 does not). The real class goes through the scheduler in
test_pair.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from vllm_overlay.simulate.outputs import model_runner_output


@dataclass
class WithIndex:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class WithoutIndex:
    req_ids: list[str]
    sampled_token_ids: list[list[int]] = field(default_factory=list)


@pytest.mark.parametrize("cls", [WithIndex, WithoutIndex])
def test_the_index_is_given_only_to_a_class_that_takes_it(
    monkeypatch: pytest.MonkeyPatch, cls: type
) -> None:
    import vllm.v1.outputs

    monkeypatch.setattr(vllm.v1.outputs, "ModelRunnerOutput", cls)
    out = model_runner_output(["b", "a"], sampled_token_ids=[[7], []])
    assert isinstance(out, cls)
    assert out.req_ids == ["b", "a"] and out.sampled_token_ids == [[7], []]
    if cls is WithIndex:
        assert out.req_id_to_index == {"b": 0, "a": 1}


def test_the_class_is_inspected_once_not_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The simulator builds an output every scheduler step: the class's
    signature is read once per class, not once per output."""
    import inspect

    import vllm.v1.outputs

    @dataclass
    class Counted:
        req_ids: list[str]

    seen: list[object] = []
    real = inspect.signature

    def counting(obj: object) -> inspect.Signature:
        seen.append(obj)
        return real(obj)

    monkeypatch.setattr(vllm.v1.outputs, "ModelRunnerOutput", Counted)
    monkeypatch.setattr(inspect, "signature", counting)
    for _ in range(3):
        model_runner_output(["a"])
    assert seen == [Counted]
