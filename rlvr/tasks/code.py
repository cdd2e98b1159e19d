"""Procedural, seeded coding problems: write a small integer function, checked by assert tests.

Each problem asks for `f(x)` computing a short expression of x ("x * 3 + 1", "7 - x", "x * x + 2",
"the larger of x and 5"), or at three steps a branch, a sum or a remainder ("4 if x is even,
otherwise x * 3"); its gold is a JSON object of assert statements for `verifier.kind: code`
(rlvr/verifiers/code.py) and its reference solution a fenced Python block (SFT warm-up). Ids are
content hashes; the split is by a hash of the expression, so no training problem asks for the same
function as a held-out one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import numpy as np

from rlvr.tasks.base import Problem

MAX_ATTEMPTS_PER_PROBLEM = 200
TEST_INPUTS = (0, 1, 2, 5, -3)
# (template of the expression, its Python body, how to compute it, its steps); a and b are drawn
# operands. `difficulty.min_steps`..`max_steps` picks the forms (1-2 by default).
FORMS: tuple[tuple[str, str, Callable[[int, int, int], int], int], ...] = (
    ("x * {a} + {b}", "x * {a} + {b}", lambda x, a, b: x * a + b, 2),
    ("x * {a} - {b}", "x * {a} - {b}", lambda x, a, b: x * a - b, 2),
    ("x + {a}", "x + {a}", lambda x, a, b: x + a, 1),
    ("{a} - x", "{a} - x", lambda x, a, b: a - x, 1),
    ("x * x + {a}", "x * x + {a}", lambda x, a, b: x * x + a, 2),
    ("the larger of x and {a}", "max(x, {a})", lambda x, a, b: max(x, a), 1),
    (
        "{a} if x is even, otherwise x * {b}",
        "{a} if x % 2 == 0 else x * {b}",
        lambda x, a, b: a if x % 2 == 0 else x * b,
        3,
    ),
    (
        "x * {a} if x is greater than 1, otherwise x - {b}",
        "x * {a} if x > 1 else x - {b}",
        lambda x, a, b: x * a if x > 1 else x - b,
        3,
    ),
    (
        "the sum of the integers from x to x + {a}",
        "sum(range(x, x + {a} + 1))",
        lambda x, a, b: sum(range(x, x + a + 1)),
        3,
    ),
    (
        "the remainder of x * {a} + {b} divided by 7",
        "(x * {a} + {b}) % 7",
        lambda x, a, b: (x * a + b) % 7,
        3,
    ),
    (
        "the absolute value of x - {a}, times {b}",
        "abs(x - {a}) * {b}",
        lambda x, a, b: abs(x - a) * b,
        3,
    ),
)


def _split_of(key: str) -> str:
    return "test" if int(hashlib.sha256(key.encode()).hexdigest(), 16) % 5 == 0 else "train"


class CodeTask:
    """Seeded generator of `write f(x)` problems; `max_operand` bounds the constants a and b,
    `min_steps`..`max_steps` the forms drawn."""

    def __init__(self, seed: int = 0, max_operand: int = 9, min_steps: int = 1, max_steps: int = 2):
        if max_operand < 2:
            raise ValueError("max_operand must be >= 2")
        self.forms = [f for f in FORMS if min_steps <= f[3] <= max_steps]
        if not self.forms:
            steps = sorted({f[3] for f in FORMS})
            raise ValueError(f"no code form has {min_steps}-{max_steps} steps; forms have {steps}")
        self.seed = seed
        self.max_operand = max_operand

    def _draw(self, rng: np.random.Generator) -> tuple[str, Problem]:
        text, body, fn, _ = self.forms[int(rng.integers(len(self.forms)))]
        a = int(rng.integers(2, self.max_operand + 1))
        b = int(rng.integers(1, self.max_operand + 1))
        expression = text.format(a=a, b=b)
        code_body = body.format(a=a, b=b)
        asserts = [f"assert f({x}) == {fn(x, a, b)}" for x in TEST_INPUTS]
        key = f"f(x) = {code_body}"
        prompt = f"Write a Python function f(x) that returns {expression} for an integer x."
        solution = f"```python\ndef f(x):\n    return {code_body}\n```"
        problem = Problem(
            id="code-" + hashlib.sha256(key.encode()).hexdigest()[:12],
            prompt=prompt,
            answer=json.dumps({"asserts": asserts}),
            solution=solution,
        )
        return key, problem

    def problems(self, split: str, n: int) -> list[Problem]:
        """Up to `n` distinct problems of `split` ("train" or "test"), the same for a given seed
        (fewer when the space of functions runs out)."""
        if split not in ("train", "test"):
            raise ValueError("split must be 'train' or 'test'")
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1])
        seen: set[str] = set()
        out: list[Problem] = []
        attempts = 0
        while len(out) < n and attempts < n * MAX_ATTEMPTS_PER_PROBLEM:
            attempts += 1
            key, problem = self._draw(rng)
            if key in seen or _split_of(key) != split:
                continue
            seen.add(key)
            out.append(problem)
        return out
