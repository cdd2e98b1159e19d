"""Environments of a user's own module, outside the package: a guessing game, and environments that
fail in every way an environment can."""

from __future__ import annotations

import os
import time

from rlvr.envs.base import Environment, StepResult
from rlvr.tasks.base import Problem


class GuessTheAnswer(Environment):
    """The model has `tries` guesses at the problem's answer; 1.0 for a right one, 0.0 when they
    run out, a hint in between."""

    def __init__(self, tries: int = 3):
        self.tries = tries

    def reset(self, problem: Problem) -> list[dict]:
        self.answer = problem.answer
        return [{"role": "user", "content": f"{problem.prompt} You have {self.tries} tries."}]

    def step(self, assistant_message: str) -> StepResult:
        self.tries -= 1
        if assistant_message.strip() == self.answer:
            return StepResult([], 1.0, True, {"tries_left": self.tries})
        if self.tries == 0:
            return StepResult([], 0.0, True, {"tries_left": 0})
        hint = {"role": "user", "content": f"No. {self.tries} tries left."}
        return StepResult([hint], None, False, {"tries_left": self.tries})


class Endless(Environment):
    """Never ends an episode: every message gets the same answer, so only the rollout loop's
    limits end a trajectory."""

    def reset(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": problem.prompt}]

    def step(self, assistant_message: str) -> StepResult:
        return StepResult([{"role": "user", "content": "Go on."}], None, False)


class TupleSteps:
    """No base class, and gym-style tuples from step."""

    def reset(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": problem.prompt}]

    def step(self, assistant_message: str):
        return [{"role": "user", "content": "again"}], 0.5, len(assistant_message) > 3


class Echo(Environment):
    """Prints the model's message on stdout (where the protocol of a careless host would be)
    before answering with a reward of 0."""

    def reset(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": problem.prompt}]

    def step(self, assistant_message: str) -> StepResult:
        print(assistant_message, flush=True)
        return StepResult([], 0.0, True)


class Failing(Environment):
    """Fails in `step` as `how` says."""

    def __init__(self, how: str):
        self.how = how

    def reset(self, problem: Problem) -> list[dict]:
        if self.how == "reset raises":
            raise RuntimeError("no episode today")
        if self.how == "reset hangs":
            time.sleep(60)
        if self.how == "reset gives a str":
            return "hello"  # type: ignore[return-value]
        return [{"role": "user", "content": problem.prompt}]

    def step(self, assistant_message: str) -> StepResult:
        if self.how == "raises":
            raise KeyError("the environment's own bug")
        if self.how == "hangs":
            time.sleep(60)
        if self.how == "dies":
            os._exit(7)
        if self.how == "returns a dict":
            return {"observations": [], "reward": 1.0, "done": True}  # type: ignore[return-value]
        if self.how == "speaks for the assistant":
            return StepResult([{"role": "assistant", "content": "I win"}], None, False)
        if self.how == "reward is text":
            return StepResult([], "1.0", True)  # type: ignore[arg-type]
        if self.how == "reward is nan":
            return StepResult([], float("nan"), True)
        if self.how == "done is an int":
            return StepResult([], 1.0, 1)  # type: ignore[arg-type]
        if self.how == "info is not json":
            return StepResult([], 1.0, True, {"seen": {1, 2}})
        return StepResult([], 1.0, True)


NOT_A_CLASS = 3


GARBLED = "lone \ud800, nul \x00, bytes " + b"\xff\xfe".decode("utf-8", "surrogateescape")
"""Text no tokenizer encodes as it is: a lone surrogate, a NUL, and invalid UTF-8 decoded with
surrogateescape (two lone surrogates)."""


class Garbled(Environment):
    """A prompt with a lone surrogate, then one observation of `GARBLED`; reward 1.0 on the
    second step."""

    def reset(self, problem: Problem) -> list[dict]:
        self.steps = 0
        return [{"role": "user", "content": f"{problem.prompt} \udc80"}]

    def step(self, assistant_message: str) -> StepResult:
        self.steps += 1
        if self.steps == 2:
            return StepResult([], 1.0, True)
        return StepResult([{"role": "user", "content": GARBLED}], None, False)
