"""Procedural, seeded arithmetic problems with gold answers and step-by-step reference solutions.

Difficulty is the number of operations, the operand range and the operators; a problem is either a
plain expression ("Compute 12 + 5 - 3.") or a short word problem. Ids are content hashes, so they
are stable across runs, and no training problem shares its computation with a held-out problem.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from rlvr.tasks.base import Problem

Style = Literal["expression", "words", "mixed"]
Reasoning = Literal["short", "long"]
Split = Literal["train", "test"]

NAMES = (("Tom", "He"), ("Ana", "She"), ("Lee", "He"), ("Mia", "She"), ("Sam", "He"))
NAMES += (("Ivy", "She"), ("Max", "He"), ("Zoe", "She"))
ITEMS = ("apple", "book", "marble", "coin", "sticker", "pencil", "card", "shell")
PHRASES = {
    "+": ("buys {n} more", "finds {n} more", "gets {n} more", "is given {n} more"),
    "-": ("gives away {n}", "loses {n}", "sells {n}", "uses up {n}"),
    "*": ("ends up with {n} times as many", "multiplies the pile by {n}"),
}
# Multipliers stay small by default so answers stay in the range a small model can learn to compute
# (difficulty.max_multiplier raises it: products a model can only get right with a calculator).
MAX_MULTIPLIER = 5
MAX_ATTEMPTS_PER_PROBLEM = 200
DEFAULT_N_TEST = 100

Computation = tuple[int, tuple[tuple[str, int], ...]]
"""(start, ((operator, operand), ...)): what a problem computes, whatever its wording."""


@dataclass(frozen=True)
class ArithmeticDifficulty:
    """How hard the problems are: steps per problem, operand range, operators, wording."""

    min_steps: int = 1
    max_steps: int = 2
    max_operand: int = 20
    operators: str = "+-"
    style: Style = "expression"
    verbosity: int = 0
    reasoning: Reasoning = "short"
    max_multiplier: int = MAX_MULTIPLIER

    def __post_init__(self) -> None:
        if self.min_steps < 1 or self.max_steps < self.min_steps:
            raise ValueError("need 1 <= min_steps <= max_steps")
        if self.max_operand < 2:
            raise ValueError("max_operand must be >= 2")
        if self.max_multiplier < 2:
            raise ValueError("max_multiplier must be >= 2")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError("operators must be a non-empty subset of '+-*'")
        if self.style not in ("expression", "words", "mixed"):
            raise ValueError("style must be 'expression', 'words' or 'mixed'")
        if self.verbosity < 0:
            raise ValueError("verbosity must be >= 0")
        if self.reasoning not in ("short", "long"):
            raise ValueError("reasoning must be 'short' or 'long'")


def _step(value: int, symbol: str, operand: int) -> int:
    if symbol == "+":
        return value + operand
    if symbol == "-":
        return value - operand
    return value * operand


def _values(computation: Computation) -> list[int]:
    """Running value after each step, starting with the start value."""
    start, ops = computation
    values = [start]
    for symbol, operand in ops:
        values.append(_step(values[-1], symbol, operand))
    return values


def _solution(computation: Computation, verbosity: int = 0) -> str:
    """Step-by-step reference; `verbosity` > 0 adds 0..verbosity re-check lines after each step.

    The number of re-checks is a hash of the computation, so the same problem always gets the same
    trace while the corpus spans every length: a verbose start for length-control studies.
    """
    values = _values(computation)
    lines = []
    for i, (symbol, operand) in enumerate(computation[1]):
        line = f"{values[i]} {symbol} {operand} = {values[i + 1]}"
        lines.append(line)
        if verbosity:
            digest = hashlib.sha1(f"{computation}/{i}".encode()).digest()
            lines.extend([f"Check again: {line}."] * (digest[0] % (verbosity + 1)))
    return "\n".join(lines) + f"\nThe answer is \\boxed{{{values[-1]}}}."


WORDED = {
    "+": "We add {o} to {v}. ",
    "-": "We subtract {o} from {v}. ",
    "*": "We multiply {v} by {o}. ",
}
CORRECTION_RATE = 64
"""Out of 256: the share of steps whose long trace first writes a wrong result, then corrects it."""


def _slip(value: int, digest: bytes) -> int:
    """A plausible wrong result near `value` (off by 1, 2 or 10), never equal to it."""
    off = (1, 2, 10)[digest[2] % 3] * (1 if digest[3] % 2 else -1)
    return value + off


def _long_solution(computation: Computation) -> str:
    """Step-by-step trace for reasoning models (arXiv:2605.08441 assumes a policy that reasons at
    length, then writes its answer marker): each step written out, about a quarter of them first
    slipped then corrected ("Wait, ..."), and a detail level (terse, worded, worded plus a final
    re-check) hashed from the computation, so lengths spread at every number of steps and a
    correct answer is not simply a short one. Always ends with a sentence holding `\\boxed{}`."""
    values = _values(computation)
    detail = hashlib.sha1(f"{computation}/detail".encode()).digest()[0] % 3
    lines = ["Let me solve this step by step.", f"We start with {values[0]}."]
    corrections = 0
    for i, (symbol, operand) in enumerate(computation[1]):
        digest = hashlib.sha1(f"{computation}/long/{i}".encode()).digest()
        before, after = values[i], values[i + 1]
        head = f"Step {i + 1}: " + (WORDED[symbol].format(v=before, o=operand) if detail else "")
        if digest[1] < CORRECTION_RATE:
            corrections += 1
            wrong = _slip(after, digest)
            lines.append(f"{head}{before} {symbol} {operand} = {wrong}.")
            lines.append(
                f"Wait, {before} {symbol} {operand} is {after}, not {wrong}. "
                f"So the result is {after}."
            )
        else:
            lines.append(f"{head}{before} {symbol} {operand} = {after}.")
    if detail == 2 and corrections < 2:  # bounds the longest trace (under 256 tokens)
        chain = ", ".join(
            f"{values[i]} {s} {o} = {values[i + 1]}" for i, (s, o) in enumerate(computation[1])
        )
        lines.append(f"Check: {chain}. Correct.")
    lines.append(f"So the final answer is \\boxed{{{values[-1]}}}.")
    return "\n".join(lines)


def _expression(computation: Computation) -> str:
    start, ops = computation
    expr = str(start)
    previous = None
    for symbol, operand in ops:
        # Steps run left to right; a product after a sum or difference needs parentheses.
        if symbol == "*" and previous in ("+", "-"):
            expr = f"({expr})"
        expr = f"{expr} {symbol} {operand}"
        previous = symbol
    return f"Compute {expr}."


class ArithmeticTask:
    """Seeded generator of `Problem`s; the same (difficulty, seed, n_test) always gives the same.

    The held-out split is the first `n_test` distinct problems of its own seed stream; training
    problems come from another stream and skip every computation in the held-out split, so the
    splits are disjoint however many training problems are asked for.
    """

    def __init__(
        self,
        difficulty: ArithmeticDifficulty | None = None,
        seed: int = 0,
        n_test: int = DEFAULT_N_TEST,
    ):
        if n_test < 1:
            raise ValueError("n_test must be >= 1")
        self.difficulty = difficulty or ArithmeticDifficulty()
        self.seed = seed
        self.n_test = n_test

    def _draw(self, rng: np.random.Generator) -> Computation:
        d = self.difficulty
        start = int(rng.integers(1, d.max_operand + 1))
        value = start
        ops: list[tuple[str, int]] = []
        for _ in range(int(rng.integers(d.min_steps, d.max_steps + 1))):
            symbol = str(rng.choice(list(d.operators)))
            if symbol == "-" and value < 1:
                symbol = "+"  # word problems cannot take away what is not there
            if symbol == "*":
                operand = int(rng.integers(2, min(d.max_multiplier, d.max_operand) + 1))
            elif symbol == "-":
                operand = int(rng.integers(1, min(value, d.max_operand) + 1))
            else:
                operand = int(rng.integers(1, d.max_operand + 1))
            ops.append((symbol, operand))
            value = _step(value, symbol, operand)
        return start, tuple(ops)

    def _words(self, rng: np.random.Generator, computation: Computation) -> str:
        start, ops = computation
        name, pronoun = NAMES[int(rng.integers(len(NAMES)))]
        item = ITEMS[int(rng.integers(len(ITEMS)))]
        items = f"{item}s"
        clauses = [
            PHRASES[symbol][int(rng.integers(len(PHRASES[symbol])))].format(n=operand)
            for symbol, operand in ops
        ]
        owned = item if start == 1 else items
        return (
            f"{name} has {start} {owned}. {pronoun} {', then '.join(clauses)}. "
            f"How many {items} does {pronoun.lower()} have now?"
        )

    def _stream(self, split: Split) -> Iterator[tuple[Computation, Problem]]:
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1])
        while True:
            computation = self._draw(rng)
            style = self.difficulty.style
            if style == "mixed":
                style = "words" if rng.random() < 0.5 else "expression"
            prompt = self._words(rng, computation) if style == "words" else _expression(computation)
            problem = Problem(
                id="arith-" + hashlib.sha1(prompt.encode()).hexdigest()[:12],
                prompt=prompt,
                answer=str(_values(computation)[-1]),
                solution=(
                    _long_solution(computation)
                    if self.difficulty.reasoning == "long"
                    else _solution(computation, self.difficulty.verbosity)
                ),
            )
            yield computation, problem

    def _distinct(
        self, split: Split, n: int, exclude: frozenset[Computation]
    ) -> list[tuple[Computation, Problem]]:
        out: list[tuple[Computation, Problem]] = []
        seen = set(exclude)
        for attempt, (computation, problem) in enumerate(self._stream(split)):
            if len(out) == n:
                return out
            if attempt >= MAX_ATTEMPTS_PER_PROBLEM * max(n, 1):
                raise ValueError(
                    f"only {len(out)} distinct {split} arithmetic problems found for n={n}: "
                    "raise difficulty.max_operand / max_steps or ask for fewer problems"
                )
            if computation not in seen:
                seen.add(computation)
                out.append((computation, problem))
        raise AssertionError("the problem stream is infinite")

    @cached_property
    def _held_out(self) -> list[tuple[Computation, Problem]]:
        return self._distinct("test", self.n_test, frozenset())

    def problems(self, split: Split, n: int) -> list[Problem]:
        """The first `n` distinct problems of `split` (for "test", at most `n_test`)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if n < 0:
            raise ValueError("n must be >= 0")
        if split == "test":
            if n > self.n_test:
                raise ValueError(
                    f"asked for {n} test problems but the task holds out {self.n_test}"
                )
            return [p for _, p in self._held_out[:n]]
        held_out = frozenset(c for c, _ in self._held_out)
        return [p for _, p in self._distinct("train", n, held_out)]

    def corpus(self, n: int = 2000) -> Iterator[str]:
        """Text for training a tokenizer: prompts and reference solutions of both streams."""
        for split in ("train", "test"):
            for (_, p), _ in zip(self._stream(split), range(n), strict=False):
                yield p.prompt
                yield p.solution
