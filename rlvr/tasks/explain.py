"""Procedural "explain, then answer" problems with free-text reference answers and no exact verifier.

Each problem comes from a seeded template (compare two amounts, a total cost, an age in some years,
ordering three numbers); its reference solution is a short explanation, the delimiter line
`Answer:` and a one-sentence reference answer. Only a few tokens of that sentence (the numbers and
names) depend on the reasoning: the few "reasoning-reflective" tokens DRO's R3 reward emphasises
(arXiv:2506.13351, Sec. 3.1.1-3.2).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from rlvr.tasks.base import Problem

ANSWER_DELIMITER = "Answer:"
"""Separates the explanation from the final answer in every reference solution."""

NAMES = ("Tom", "Ana", "Lee", "Mia", "Sam", "Ivy", "Max", "Zoe")
ITEMS = ("apple", "book", "marble", "coin", "sticker", "pencil", "card", "shell")
PRICED = ("pen", "cup", "ball", "kite", "lamp", "hat")
RELATIVES = ("brother", "sister", "cousin")
SUFFIX = " Explain, then answer."
MAX_ATTEMPTS_PER_PROBLEM = 200


@dataclass(frozen=True)
class Worked:
    """One drawn instance: the question, its explanation lines, the reference sentence and the key."""

    prompt: str
    steps: tuple[str, ...]
    reference: str
    key: str


def _compare(rng: np.random.Generator, top: int) -> Worked:
    a, b = (str(x) for x in rng.choice(NAMES, 2, replace=False))
    item = str(rng.choice(ITEMS))
    x, y = (int(v) for v in rng.choice(np.arange(1, top + 1), 2, replace=False))
    (win, hi), (lose, lo) = sorted([(a, x), (b, y)], key=lambda t: -t[1])
    return Worked(
        prompt=f"{a} has {x} {item}s and {b} has {y} {item}s. "
        f"Who has more {item}s, and how many more?",
        steps=(f"{a} has {x} and {b} has {y}.", f"{hi} - {lo} = {hi - lo}, so {win} has more."),
        reference=f"{win} has {hi - lo} more {item}s than {lose}.",
        key=str(hi - lo),
    )


def _total(rng: np.random.Generator, top: int) -> Worked:
    name = str(rng.choice(NAMES))
    first, second = (str(x) for x in rng.choice(PRICED, 2, replace=False))
    p, q = (int(rng.integers(1, min(top, 9) + 1)) for _ in range(2))
    m = int(rng.integers(2, 5))
    total = m * p + q
    return Worked(
        prompt=f"A {first} costs {p} coins and a {second} costs {q} coins. "
        f"{name} buys {m} {first}s and one {second}. How many coins does {name} pay?",
        steps=(f"{m} {first}s cost {m} * {p} = {m * p}.", f"{m * p} + {q} = {total}."),
        reference=f"{name} pays {total} coins.",
        key=str(total),
    )


def _age(rng: np.random.Generator, top: int) -> Worked:
    name = str(rng.choice(NAMES))
    relative = str(rng.choice(RELATIVES))
    age, older, years = (int(rng.integers(1, top + 1)) for _ in range(3))
    now = age + older
    return Worked(
        prompt=f"{name} is {age} years old. {name}'s {relative} is {older} years older. "
        f"How old will the {relative} be in {years} years?",
        steps=(
            f"The {relative} is {age} + {older} = {now} now.",
            f"{now} + {years} = {now + years}.",
        ),
        reference=f"The {relative} will be {now + years} years old.",
        key=str(now + years),
    )


def _order(rng: np.random.Generator, top: int) -> Worked:
    values = [int(v) for v in rng.choice(np.arange(1, top + 1), 3, replace=False)]
    lo, mid, hi = sorted(values)
    listed = ", ".join(str(v) for v in values)
    return Worked(
        prompt=f"Sort these numbers from smallest to largest: {listed}.",
        steps=(f"The smallest is {lo} and the largest is {hi}.", f"{mid} lies between them."),
        reference=f"From smallest to largest: {lo}, {mid}, {hi}.",
        key=f"{lo}, {mid}, {hi}",
    )


TEMPLATES: dict[str, Callable[[np.random.Generator, int], Worked]] = {
    "compare": _compare,
    "total": _total,
    "age": _age,
    "order": _order,
}


def worked_solution(worked: Worked) -> str:
    """The reference solution: explanation lines, then `Answer:` and the reference sentence."""
    return "\n".join(worked.steps) + f"\n{ANSWER_DELIMITER} {worked.reference}"


class ExplainTask:
    """Seeded generator of explain-then-answer `Problem`s, split like the arithmetic task.

    `Problem.reference` is the sentence after `Answer:` with its leading space (so it tokenizes as
    it does inside the solution); `Problem.answer` is the key value in it (a number, or the sorted
    list), a sanity check for evaluation rather than a verifier target. The held-out split is the
    first `n_test` distinct problems of its own stream; training problems skip every held-out
    prompt.
    """

    def __init__(
        self,
        seed: int = 0,
        n_test: int = 100,
        max_operand: int = 20,
        templates: tuple[str, ...] = tuple(TEMPLATES),
    ):
        unknown = sorted(set(templates) - set(TEMPLATES))
        if unknown or not templates:
            raise ValueError(f"templates must be a non-empty subset of {sorted(TEMPLATES)}")
        if max_operand < 3:
            raise ValueError("max_operand must be >= 3 (ordering needs three distinct numbers)")
        if n_test < 1:
            raise ValueError("n_test must be >= 1")
        self.seed = seed
        self.n_test = n_test
        self.max_operand = max_operand
        self.templates = tuple(templates)

    def _stream(self, split: str) -> Iterator[Problem]:
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, 7])
        while True:
            template = self.templates[int(rng.integers(len(self.templates)))]
            worked = TEMPLATES[template](rng, self.max_operand)
            prompt = worked.prompt + SUFFIX
            yield Problem(
                id="explain-" + hashlib.sha1(prompt.encode()).hexdigest()[:12],
                prompt=prompt,
                answer=worked.key,
                solution=worked_solution(worked),
                reference=" " + worked.reference,
            )

    def _distinct(self, split: str, n: int, exclude: frozenset[str]) -> list[Problem]:
        out: list[Problem] = []
        seen = set(exclude)
        for attempt, problem in enumerate(self._stream(split)):
            if len(out) == n:
                return out
            if attempt >= MAX_ATTEMPTS_PER_PROBLEM * max(n, 1):
                raise ValueError(
                    f"only {len(out)} distinct {split} explain problems found for n={n}: "
                    "raise max_operand or ask for fewer problems"
                )
            if problem.prompt not in seen:
                seen.add(problem.prompt)
                out.append(problem)
        raise AssertionError("the problem stream is infinite")

    def problems(self, split: str, n: int) -> list[Problem]:
        """The first `n` distinct problems of `split` ("train" or "test", at most `n_test`)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if n < 0:
            raise ValueError("n must be >= 0")
        held_out = self._distinct("test", self.n_test, frozenset())
        if split == "test":
            if n > self.n_test:
                raise ValueError(
                    f"asked for {n} test problems but the task holds out {self.n_test}"
                )
            return held_out[:n]
        return self._distinct("train", n, frozenset(p.prompt for p in held_out))
