"""A multi-turn rollout as pure data, shared by the engine loop that writes it and the trainer that
reads it: the prompt, then per turn the ids the model sampled (with the engine's log-probs) and
the observation ids inserted before its next turn (rlvr.envs.chat.ChatRenderer), and why it
ended. The sequence the trainer sees is prompt_ids + completion_ids_1 + observation_ids_1 + ...
+ completion_ids_T, positions continuous; it trains on the model's ids only (`loss_mask`).

The engine loop, per turn: sample from `token_ids()`; `step` the environment on the text; the
turn's observation ids, unless it was the last, are `renderer.observation_ids([*messages(),
{"role": "assistant", "content": text}], completion_ids, observations)`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rlvr.envs.base import ENV_FAILURES, Message

__all__ = ["END_REASONS", "Trajectory", "Turn"]

END_REASONS = ("done", "max_turns", "token_budget", "context_limit", *ENV_FAILURES)
"""Why a trajectory ended: the environment said done; `env.max_turns` turns; the token budget
over all the model's turns; the model's context; or the environment failed (ENV_FAILURES)."""


@dataclass
class Turn:
    """One turn of the model and the environment's answer to it."""

    completion_ids: list[int]
    """The ids the model sampled, its stop token included where it sampled one."""
    logprobs: list[float]
    """The engine's log-prob of each of `completion_ids`."""
    text: str
    """The assistant message the environment read (decoded, special tokens left out)."""
    finish_reason: str
    """The engine's: 'stop', 'length' or 'abort'."""
    observation: list[Message] = field(default_factory=list)
    """The environment's answer (empty after the last turn)."""
    observation_ids: list[int] = field(default_factory=list)
    """What follows `completion_ids` before the next turn: the end of the assistant turn the
    model did not write, the observation, the next turn's opening (empty after the last)."""
    reward: float | None = None
    """The environment's reward for this turn (None: none)."""
    info: dict[str, Any] = field(default_factory=dict)
    """The environment's info for this turn (tool-call statuses, for one)."""

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"{len(self.completion_ids)} completion ids but {len(self.logprobs)} log-probs"
            )


@dataclass
class Trajectory:
    """The prompt and the turns of one rollout."""

    prompt: list[Message]
    """The messages `reset` gave."""
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    end_reason: str = ""
    """One of END_REASONS once it ended; "" while it runs."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """The tool schemas the chat template announced."""

    def end(self, reason: str) -> None:
        """Record why it ended (one of END_REASONS)."""
        if reason not in END_REASONS:
            raise ValueError(f"end reason {reason!r} is not one of {END_REASONS}")
        self.end_reason = reason

    def token_ids(self) -> list[int]:
        """The whole sequence: prompt, then each turn's completion and observation ids."""
        ids = list(self.prompt_ids)
        for turn in self.turns:
            ids += turn.completion_ids + turn.observation_ids
        return ids

    def loss_mask(self) -> list[int]:
        """1 on the ids the model sampled, 0 on the prompt and the observations; over
        `token_ids`."""
        mask = [0] * len(self.prompt_ids)
        for turn in self.turns:
            mask += [1] * len(turn.completion_ids) + [0] * len(turn.observation_ids)
        return mask

    def token_logprobs(self) -> list[float]:
        """The engine's log-prob of each sampled id, 0.0 elsewhere; over `token_ids`."""
        out = [0.0] * len(self.prompt_ids)
        for turn in self.turns:
            out += list(turn.logprobs) + [0.0] * len(turn.observation_ids)
        return out

    def model_tokens(self) -> int:
        """How many ids the model wrote over all its turns (the token budget's, and a length
        penalty's, length)."""
        return sum(len(t.completion_ids) for t in self.turns)

    def messages(self) -> list[Message]:
        """The conversation: the prompt, then each assistant message and its observation."""
        out = [dict(m) for m in self.prompt]
        for turn in self.turns:
            out.append({"role": "assistant", "content": turn.text})
            out += [dict(m) for m in turn.observation]
        return out

    def env_reward(self) -> float | None:
        """The sum of the turns' environment rewards; None when no turn had one (the verifier
        scores the last message)."""
        rewards = [t.reward for t in self.turns if t.reward is not None]
        return sum(rewards) if rewards else None

    def final_text(self) -> str:
        """The last assistant message (the answer a verifier scores)."""
        return self.turns[-1].text if self.turns else ""

    def to_data(self) -> dict[str, Any]:
        """Plain data (JSON-ready when every info is)."""
        return asdict(self)

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Trajectory:
        """The trajectory `to_data` gave `data` for."""
        turns = [Turn(**t) for t in data["turns"]]
        return cls(**{**data, "turns": turns})
