"""The GSM8K-style accuracy gate's generated problems and scoring."""

from __future__ import annotations

import re

import pytest

from vllm_overlay.e2e import accuracy


def test_problems_are_deterministic_and_varied() -> None:
    a, b = accuracy.problems(60, seed=3), accuracy.problems(60, seed=3)
    assert a == b
    assert accuracy.problems(60, seed=4) != a
    assert len({p.question for p in a}) == 60
    # Every template, and every answer a positive whole number.
    assert len({p.question.split()[1] for p in a}) == len(accuracy.TEMPLATES)
    assert all(p.answer > 0 for p in a)


@pytest.mark.parametrize("index", range(12))
def test_worked_steps_compute_the_answer(index: int) -> None:
    problem = accuracy.problems(12, seed=7)[index]
    # Each "a op b = c" step in the reasoning is right, and the last result
    # is the answer.
    for expr, result in re.findall(r"([\d+\-x ]+?) = (\d+)", problem.reasoning):
        value = eval(expr.replace("x", "*"))  # noqa: S307 - digits and + - * only
        assert value == int(result), (expr, result)
    assert problem.reasoning.endswith(f"The answer is {problem.answer}.")
    assert accuracy.extract(problem.reasoning) == problem.answer


def test_prompt_has_the_worked_examples_then_the_question() -> None:
    scored = accuracy.prompts(3, shots=2, seed=1)
    assert len(scored) == 3
    problem, text = scored[0]
    assert text.count("Question:") == 3 and text.endswith("Answer:")
    assert text.rsplit("Question: ", 1)[1].startswith(problem.question)
    examples = accuracy.problems(5, seed=1)[:2]
    assert all(e.reasoning in text for e in examples)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (" 3 x 4 = 12; 5 + 12 = 17. The answer is 17.", 17),
        (" The answer is 1,234.\n\nQuestion: next one has 99", 1234),
        (" so she has 42 apples", 42),
        (" I do not know", None),
        (" The answer is -5.", -5),
    ],
)
def test_extract(text: str, value: int | None) -> None:
    assert accuracy.extract(text) == value


def test_score() -> None:
    problems = accuracy.problems(4)
    answers = [f" The answer is {p.answer}." for p in problems]
    assert accuracy.score(answers, problems) == 1.0
    answers[0] = " The answer is 0."
    assert accuracy.score(answers, problems) == 0.75
    assert accuracy.score([], []) == 0.0
