"""The text-environment protocol of multi-turn rollouts, gym style: `reset(problem)` gives the first
messages, `step(assistant_message)` answers each of the model's turns with a `StepResult`
(observation messages, a reward or None, done). The built-in environment is the tool-calling
loop (rlvr.envs.tool_env); a user's own is a class "pkg.module:Cls" run in a process of its own
(rlvr.envs.hosted).

Messages are plain dicts: `role` and `content` (str), and `name` (str) on a tool message. What
`reset` gives is the prompt: system, user, assistant (few-shot) and tool messages. What `step`
gives back is the environment's answer: user and tool messages only, never words in the
assistant's mouth. A reward of None leaves the trajectory to the verifier. A failed environment
(it raised, hung, died or answered in the wrong shape) raises `EnvironmentFailed` with one of
`ENV_FAILURES`; the trajectory ends there with that status as its reason, and its reward is
uncomputed (`AGENT_FAILURES`): it trains nothing and counts toward `verifier.max_uncomputed_share`.

Text is the environment's (and its tools') to choose, so it may hold what no tokenizer encodes:
lone surrogates (a tool printing '\\ud800', invalid UTF-8 decoded with surrogateescape).
`repair_messages` replaces each such code point by U+FFFD and counts them; the trajectory goes on.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlvr.tasks.base import Problem

__all__ = [
    "AGENT_FAILURES",
    "ENV_FAILURES",
    "OBSERVATION_ROLES",
    "PROMPT_ROLES",
    "Environment",
    "EnvironmentFailed",
    "Message",
    "StepResult",
    "check_messages",
    "check_step_result",
    "repair_messages",
    "repair_text",
]

Message = dict[str, str]
PROMPT_ROLES = ("system", "user", "assistant", "tool")
OBSERVATION_ROLES = ("user", "tool")
ENV_FAILURES = ("env_error", "env_timeout", "env_bad_result", "env_crashed")
"""Why an environment failed: it raised (or could not be loaded), missed its deadline, answered
in the wrong shape, or its process died."""
AGENT_FAILURES = (*ENV_FAILURES, "callback_error", "callback_timeout")
"""End reasons of a trajectory that failed on the environment's side, not the model's: its
environment failed, or the engine loop's turn callback raised or hung
(`rlvr.generation.trajectories`). Its last message is no answer: its reward is uncomputed."""
_UNENCODABLE = re.compile("[\ud800-\udfff]")
"""The code points `str.encode('utf-8')` rejects: surrogates, which a str holds only unpaired.
NUL is valid UTF-8, and the tiny model's and SmolLM2's tokenizers encode and decode it as it is,
so it is kept."""


@dataclass
class StepResult:
    """An environment's answer to one assistant message."""

    observations: list[Message] = field(default_factory=list)
    """Messages shown to the model before its next turn (user / tool roles)."""
    reward: float | None = None
    """This step's reward; None: none from the environment (the verifier scores the answer)."""
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Plain data for metrics and logs (JSON-serialisable); never a reward."""


class Environment:
    """A text environment; subclassing it is optional (any class with `reset` and `step`
    works). One instance serves one trajectory. `tools`: the schemas the chat template
    announces (rlvr.envs.tools), none by default."""

    tools: Sequence[dict[str, Any]] = ()

    def reset(self, problem: Problem) -> list[Message]:
        """The conversation the model's first turn answers."""
        raise NotImplementedError

    def step(self, assistant_message: str) -> StepResult:
        """The answer to the model's message (its text, special tokens left out)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode held (called once it ends, failed or not)."""


class EnvironmentFailed(Exception):
    """An environment that failed; `status` is one of ENV_FAILURES."""

    def __init__(self, status: str, message: str):
        if status not in ENV_FAILURES:
            raise ValueError(f"status must be one of {ENV_FAILURES}")
        super().__init__(message)
        self.status = status


def check_messages(value: Any, roles: Sequence[str], where: str) -> list[Message]:
    """`value` as a list of messages with roles among `roles`; ValueError saying what is wrong,
    naming `where` it came from."""
    if type(value) is not list:
        raise ValueError(f"{where} gave a {type(value).__name__!r}, not a list of messages")
    out = []
    for i, message in enumerate(value):
        if type(message) is not dict or not {"role", "content"} <= set(message):
            raise ValueError(f"{where}: message {i} is not a dict with 'role' and 'content'")
        if not set(message) <= {"role", "content", "name"}:
            extra = sorted(set(message) - {"role", "content", "name"})
            raise ValueError(f"{where}: message {i} has keys {extra} besides role/content/name")
        if message["role"] not in roles:
            raise ValueError(
                f"{where}: message {i} has role {message['role']!r}, not one of {roles}"
            )
        if not all(type(v) is str for v in message.values()):
            raise ValueError(f"{where}: message {i} has a value that is not a str")
        out.append(dict(message))
    return out


def check_step_result(value: Any, where: str) -> StepResult:
    """A `StepResult` (or an `(observations, reward, done[, info])` tuple, as gym-style
    environments return) checked field by field; ValueError saying what is wrong."""
    if isinstance(value, StepResult):
        fields = (value.observations, value.reward, value.done, value.info)
    elif type(value) in (tuple, list) and len(value) in (3, 4):
        fields = (*value, {}) if len(value) == 3 else tuple(value)
    else:
        raise ValueError(
            f"{where} gave a {type(value).__name__!r}, not a StepResult or an "
            "(observations, reward, done[, info]) tuple"
        )
    observations, reward, done, info = fields
    observations = check_messages(observations, OBSERVATION_ROLES, f"{where}'s observations")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise ValueError(f"{where}: the reward is a {type(reward).__name__!r}, not a number")
        if not math.isfinite(reward):
            raise ValueError(f"{where}: the reward {reward} is not finite")
        reward = float(reward)
    if type(done) is not bool:
        raise ValueError(f"{where}: done is a {type(done).__name__!r}, not a bool")
    if type(info) is not dict:
        raise ValueError(f"{where}: info is a {type(info).__name__!r}, not a dict")
    return StepResult(observations, reward, done, info)


def repair_text(text: str) -> tuple[str, int]:
    """`text` with every code point UTF-8 cannot encode replaced by U+FFFD (visibly, so the model
    sees that something was there), and how many were replaced."""
    return _UNENCODABLE.subn("\ufffd", text)


def repair_messages(messages: Sequence[Message]) -> tuple[list[Message], int]:
    """The messages with every value repaired (`repair_text`), and the count over all of them."""
    out, count = [], 0
    for message in messages:
        repaired = {}
        for key, value in message.items():
            repaired[key], n = repair_text(value)
            count += n
        out.append(repaired)
    return out, count
