"""A GSM8K-style accuracy gate, generated here: grade-school word problems
with two or three arithmetic steps, a few worked examples before each, the
answer scored on its final number.

vLLM's ROCm P/D CI gates on GSM8K (lm_eval, exact match >= 0.90) as a second
opinion next to its functional checks. These problems are generated from a
seed instead of downloaded (the harness fetches nothing), so the same config
asks the same questions on every run, and the score is compared between the
P/D path and the direct prefill of the same model.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NAMES = ("Ada", "Bilal", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ines")
STOP = "\n\nQuestion:"


@dataclass(frozen=True)
class Problem:
    question: str
    reasoning: str  # worked steps, ending in "The answer is N."
    answer: int


Template = Callable[[random.Random], Problem]


def _apples(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    a, b, c = rng.randint(3, 40), rng.randint(2, 9), rng.randint(3, 12)
    q = (
        f"{name} has {a} apples and buys {b} bags with {c} apples in each bag. "
        "How many apples does "
        f"{name} have now?"
    )
    r = f"The bags hold {b} x {c} = {b * c} apples, so {a} + {b * c} = {a + b * c}."
    return Problem(q, f"{r} The answer is {a + b * c}.", a + b * c)


def _train(rng: random.Random) -> Problem:
    v, h = rng.randint(40, 120), rng.randint(2, 6)
    w, k = rng.randint(30, 90), rng.randint(1, 5)
    q = (
        f"A train travels at {v} km per hour for {h} hours, then at {w} km per "
        f"hour for {k} hours. How many kilometres does it travel in all?"
    )
    total = v * h + w * k
    r = (
        f"First {v} x {h} = {v * h} km, then {w} x {k} = {w * k} km; "
        f"{v * h} + {w * k} = {total}."
    )
    return Problem(q, f"{r} The answer is {total}.", total)


def _wages(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    p, h, d = rng.randint(8, 30), rng.randint(3, 9), rng.randint(2, 6)
    earned = p * h * d
    s = rng.randint(1, earned - 1)
    q = (
        f"{name} earns {p} dollars per hour and works {h} hours a day for {d} "
        f"days, then spends {s} dollars. How many dollars are left?"
    )
    r = f"{p} x {h} x {d} = {earned} dollars earned; {earned} - {s} = {earned - s}."
    return Problem(q, f"{r} The answer is {earned - s}.", earned - s)


def _pencils(rng: random.Random) -> Problem:
    n, m = rng.randint(6, 24), rng.randint(3, 15)
    g = rng.randint(1, n * m - 1)
    q = (
        f"A box holds {n} pencils. A school orders {m} boxes and hands out {g} "
        "pencils. How many pencils are left?"
    )
    r = f"{n} x {m} = {n * m} pencils; {n * m} - {g} = {n * m - g}."
    return Problem(q, f"{r} The answer is {n * m - g}.", n * m - g)


def _pages(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    p, d = rng.randint(5, 40), rng.randint(2, 9)
    t = p * d + rng.randint(1, 300)
    q = (
        f"{name} reads {p} pages a day of a book that has {t} pages. How many "
        f"pages are left after {d} days?"
    )
    r = f"{p} x {d} = {p * d} pages read; {t} - {p * d} = {t - p * d}."
    return Problem(q, f"{r} The answer is {t - p * d}.", t - p * d)


def _chairs(rng: random.Random) -> Problem:
    rows, per = rng.randint(4, 20), rng.randint(5, 16)
    x, y = rng.randint(1, rows * per // 2), rng.randint(1, 40)
    q = (
        f"A hall has {rows} rows of {per} chairs. {x} chairs are broken and "
        f"taken away, then {y} new chairs are brought in. How many chairs are "
        "in the hall now?"
    )
    total = rows * per - x + y
    r = f"{rows} x {per} = {rows * per}; {rows * per} - {x} + {y} = {total}."
    return Problem(q, f"{r} The answer is {total}.", total)


TEMPLATES: tuple[Template, ...] = (_apples, _train, _wages, _pencils, _pages, _chairs)


def problems(count: int, seed: int = 0) -> list[Problem]:
    """``count`` problems, the same for the same seed."""
    rng = random.Random(f"gsm:{seed}")
    return [TEMPLATES[i % len(TEMPLATES)](rng) for i in range(count)]


def prompt_text(problem: Problem, shots: Sequence[Problem]) -> str:
    """Worked examples, then the question; the answer follows "Answer:"."""
    parts = [f"Question: {s.question}\nAnswer: {s.reasoning}" for s in shots]
    parts.append(f"Question: {problem.question}\nAnswer:")
    return "\n\n".join(parts)


def prompts(count: int, shots: int, seed: int = 0) -> list[tuple[Problem, str]]:
    """The scored problems with their prompts; the worked examples are
    other problems of the same seed."""
    pool = problems(count + shots, seed)
    examples, scored = pool[:shots], pool[shots:]
    return [(p, prompt_text(p, examples)) for p in scored]


_ANSWER = re.compile(r"answer is\s*\$?\s*(-?[\d,]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*")


def extract(text: str) -> int | None:
    """The final number of an answer: after "The answer is", else the last
    number before the next question."""
    text = text.split("Question:")[0]
    m = _ANSWER.search(text)
    found = m.group(1) if m else (_NUMBER.findall(text) or [None])[-1]
    if found is None:
        return None
    try:
        return int(found.replace(",", ""))
    except ValueError:
        return None


def score(answers: Sequence[str], problems_: Sequence[Problem]) -> float:
    """The fraction of answers whose final number is the right one."""
    if not problems_:
        return 0.0
    right = sum(
        1
        for text, p in zip(answers, problems_, strict=True)
        if extract(text) == p.answer
    )
    return right / len(problems_)
