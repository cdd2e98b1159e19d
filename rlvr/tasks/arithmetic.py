"""Procedural, seeded arithmetic problems with gold answers and step-by-step reference solutions.

Difficulty is the number of operations, the operand range and the operators; problems are either
plain expressions ("Compute 12 + 5 - 3.") or short word problems. Ids are content hashes, so they
are stable across runs, and the held-out split never shares a problem with the training split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rlvr.tasks.base import Problem

Style = Literal["expression", "words", "mixed"]
Split = Literal["train", "test"]

NAMES = ("Tom", "Ana", "Lee", "Mia", "Sam", "Ivy", "Max", "Zoe")
ITEMS = ("apples", "books", "marbles", "coins", "stickers", "pencils", "cards", "shells")
ADD_PHRASES = ("buys {n} more", "finds {n} more", "gets {n} more", "is given {n} more")
SUB_PHRASES = ("gives away {n}", "loses {n}", "sells {n}", "uses {n}")
MUL_PHRASES = ("ends up with {n} times as many",)
MAX_ATTEMPTS_PER_PROBLEM = 200


@dataclass(frozen=True)
class ArithmeticDifficulty:
    """How hard the problems are."""

    min_steps: int = 1
    max_steps: int = 2
    max_operand: int = 20
    operators: str = "+-"
    style: Style = "expression"


@dataclass(frozen=True)
class _Op:
    symbol: str
    operand: int


def _apply(value: int, op: _Op) -> int:
    if op.symbol == "+":
        return value + op.operand
    if op.symbol == "-":
        return value - op.operand
    return value * op.operand


class ArithmeticTask:
    """Seeded generator of `Problem`s; the same (difficulty, seed) always yields the same problems."""

    def __init__(self, difficulty: ArithmeticDifficulty | None = None, seed: int = 0):
        self.difficulty = difficulty or ArithmeticDifficulty()
        self.seed = seed
        d = self.difficulty
        if d.min_steps < 1 or d.max_steps < d.min_steps:
            raise ValueError("need 1 <= min_steps <= max_steps")
        if d.max_operand < 2:
            raise ValueError("max_operand must be >= 2")
        if not d.operators or set(d.operators) - set("+-*"):
            raise ValueError("operators must be a non-empty subset of '+-*'")

    def _draw(self, rng: np.random.Generator) -> tuple[int, list[_Op]]:
        d = self.difficulty
        start = int(rng.integers(1, d.max_operand + 1))
        ops: list[_Op] = []
        value = start
        for _ in range(int(rng.integers(d.min_steps, d.max_steps + 1))):
            symbol = str(rng.choice(list(d.operators)))
            if symbol == "-" and value < 1:
                symbol = "+"
            if symbol == "*":
                operand = int(rng.integers(2, min(5, d.max_operand) + 1))
            elif symbol == "-":
                # word problems never go negative; expressions keep the same rule for uniformity
                operand = int(rng.integers(1, min(value, d.max_operand) + 1))
            else:
                operand = int(rng.integers(1, d.max_operand + 1))
            ops.append(_Op(symbol, operand))
            value = _apply(value, ops[-1])
        return start, ops

    def _render(self, rng: np.random.Generator, start: int, ops: list[_Op]) -> tuple[str, str, str]:
        style = self.difficulty.style
        if style == "mixed":
            style = "words" if rng.random() < 0.5 else "expression"
        values = [start]
        for op in ops:
            values.append(_apply(values[-1], op))
        answer = str(values[-1])
        if style == "expression":
            expr = str(start)
            steps = []
            for i, op in enumerate(ops):
                shown = op.symbol
                steps.append(f"{values[i]} {shown} {op.operand} = {values[i + 1]}")
                expr = (
                    f"({expr}) {shown} {op.operand}"
                    if op.symbol == "*" and i > 0
                    else f"{expr} {shown} {op.operand}"
                )
            prompt = f"Compute {expr}."
        else:
            name = str(rng.choice(NAMES))
            item = str(rng.choice(ITEMS))
            phrases = {"+": ADD_PHRASES, "-": SUB_PHRASES, "*": MUL_PHRASES}
            clauses = [str(rng.choice(phrases[op.symbol])).format(n=op.operand) for op in ops]
            story = f"{name} has {start} {item}. {name} " + ", then ".join(clauses) + "."
            prompt = f"{story} How many {item} does {name} have now?"
            steps = []
            for i, op in enumerate(ops):
                shown = op.symbol
                steps.append(f"{values[i]} {shown} {op.operand} = {values[i + 1]}")
        solution = "\n".join(steps) + f"\nThe answer is \\boxed{{{answer}}}."
        return prompt, answer, solution

    def _stream(self, split: Split) -> Iterator[Problem]:
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1])
        while True:
            start, ops = self._draw(rng)
            prompt, answer, solution = self._render(rng, start, ops)
            pid = "arith-" + hashlib.sha1(prompt.encode()).hexdigest()[:12]
            yield Problem(id=pid, prompt=prompt, answer=answer, solution=solution)

    def _unique(self, split: Split, n: int, exclude: set[str]) -> list[Problem]:
        out: list[Problem] = []
        seen = set(exclude)
        attempts = 0
        for p in self._stream(split):
            attempts += 1
            if attempts > MAX_ATTEMPTS_PER_PROBLEM * max(n, 1):
                raise ValueError(
                    f"only {len(out)} distinct {split} problems found for n={n}; "
                    "raise task.difficulty.max_operand / max_steps or ask for fewer problems"
                )
            if p.prompt in seen:
                continue
            seen.add(p.prompt)
            out.append(p)
            if len(out) == n:
                return out
        raise AssertionError("unreachable")

    def problems(self, split: Split, n: int, n_test: int | None = None) -> list[Problem]:
        """`n` distinct problems of `split`. Training problems exclude every one of the first
        `n_test` held-out problems (default: as many as `n`), so the splits are disjoint."""
        if split == "test":
            return self._unique("test", n, set())
        held_out = {
            p.prompt for p in self._unique("test", n_test if n_test is not None else n, set())
        }
        return self._unique("train", n, held_out)

    def corpus(self, n: int = 2000) -> Iterator[str]:
        """Text for training a tokenizer: prompts and reference solutions of both splits."""
        for split in ("train", "test"):
            for p, _ in zip(self._stream(split), range(n), strict=False):
                yield p.prompt
                yield p.solution
