"""Multi-turn rollouts: the trajectories a backend runs turn by turn, and what it records of them.

A `Trajectory` starts from `prompt_ids`. The backend samples turn 0 from it; then the trajectory's
`next_turn` callback receives the trajectory so far (a `TrajectoryResult` whose last turn has just
ended) and answers `Continue(observation_ids)` or `Finish()`. On `Continue`, turn t + 1's prompt
is exactly turn t's prompt + the tokens turn t sampled + the observation ids: token in, token out,
nothing is decoded and re-tokenised, so the model's tokens in a trajectory are the tokens it
sampled, and vLLM's prefix cache serves the earlier turns. A trajectory without a callback is
single-turn: it ends after turn 0 (`GenerationBackend.generate` runs every sample as one).
Backends run trajectories through `TrajectoryBackend` (`VLLMBackend`, `HFBackend`; the
GeneratorActor and GeneratorPool pass them on).

Callbacks may be slow (a tool or an environment in a subprocess): backends run them on a small
thread pool, off the engine's thread, while the other trajectories keep generating. A callback
sees its own trajectory only while it is paused, and must not change it.

Seeds (`turn_seed`): turn 0 of a trajectory seeded s draws from s itself, so a single-turn
trajectory samples exactly what `generate` samples for that seed (a request's sample j: its base
seed + j); turn t >= 1 draws from a 63-bit blake2b hash of (s, t), a stream of its own on every
machine. An unseeded trajectory samples every turn unseeded. Each turn also gets a fresh stop
rule (`Trajectory.stop_rule(t)`) and, in a Tandem rollout, a fresh author state machine seeded
with the turn's seed.

Limits (`TrajectoryLimits`) bound each turn's `max_tokens` by what is left of the trajectory's
token budget and context, and end a trajectory with their reason. The callback runs after every
turn, the last one allowed included (an environment sees every assistant message); when it asks
for another turn that a limit forbids, the trajectory ends with that limit's status and the
observation goes into no prompt (the reply's `info` is kept). Statuses, in the order checked:

- "done": the callback answered `Finish` (always, for a single-turn trajectory);
- "callback_error": the callback raised, or answered something other than `Continue` / `Finish`,
  observation ids that are not token ids of the model's vocabulary, or an `info` that is no dict;
- "callback_timeout": it did not answer within `callback_timeout_s` (its thread is left to
  finish on its own: a callback that can hang should bound its own work, as a tool subprocess
  with a timeout does);
- "max_turns", "token_budget" (the model's tokens over all turns reached `max_tokens`),
  "context_length" (the next prompt leaves no room for one token): `Continue` asked for a turn
  past a limit.

Only the trajectory concerned ends; the others of the call go on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from rlvr.generation.base import Sample, SamplingParams, StopRule

if TYPE_CHECKING:
    from rlvr.algorithms.tandem import WordSwitchSchedule
    from rlvr.generation.segments import Segments

TrajectoryStatus = Literal[
    "done", "callback_error", "callback_timeout", "max_turns", "token_budget", "context_length"
]


@dataclass(frozen=True)
class Continue:
    """Reply of a turn callback: go on with another turn, whose prompt is this turn's prompt +
    its sampled ids + `observation_ids` (e.g. a tool's answer rendered by the chat template)."""

    observation_ids: Sequence[int]
    info: dict[str, Any] = field(default_factory=dict)
    """Recorded on the turn just ended (`Turn.info`), e.g. the tool calls it made."""


@dataclass(frozen=True)
class Finish:
    """Reply of a turn callback: the trajectory ends after this turn (status "done")."""

    info: dict[str, Any] = field(default_factory=dict)
    """Recorded on the last turn (`Turn.info`), e.g. an environment's reward."""


TurnReply = Continue | Finish


class TurnCallback(Protocol):
    def __call__(self, trajectory: TrajectoryResult) -> TurnReply:
        """The reply to the turn that just ended (`trajectory.turns[-1]`)."""
        ...


@dataclass
class Trajectory:
    """One rollout to run, turn by turn; the backend returns a `TrajectoryResult` for it."""

    prompt_ids: list[int]
    seed: int | None = None
    """Turn t samples from `turn_seed(seed, t)`."""
    next_turn: TurnCallback | None = None
    """Called after every turn; None: the trajectory is single-turn."""
    stop_rule: Callable[[int], StopRule] | None = None
    """A fresh stop rule for turn t (e.g. DUET's marker-gated abort), consulted inside the engine."""
    trajectory_id: str = ""
    """The caller's key, returned in the result."""


@dataclass(frozen=True)
class TrajectoryLimits:
    """What ends a trajectory besides its callback (None: no limit of that kind)."""

    max_turns: int | None = None
    """Model turns at most."""
    max_tokens: int | None = None
    """Token budget of the model over all its turns (each turn also stops at params.max_tokens)."""
    max_context: int | None = None
    """Prompt + response tokens of any turn at most; the engine's own context limit applies too."""
    callback_timeout_s: float | None = None
    """Seconds a callback may take, counted from the end of the turn it answers."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "max_context"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.callback_timeout_s is not None and not self.callback_timeout_s > 0:
            raise ValueError(
                f"callback_timeout_s must be > 0 or None, got {self.callback_timeout_s}"
            )


@dataclass
class Turn:
    """One model turn of a trajectory."""

    prompt_ids: list[int]
    """Everything before this turn's response: the first prompt, then every earlier turn's
    sampled ids and observation ids."""
    seed: int | None
    """The seed this turn sampled from (`turn_seed`); a Tandem turn's author state starts from
    it too (from a fresh random seed when it is None)."""
    sample: Sample
    """The sampled ids, their engine log-probs, the finish reason, the stop rule's flags and, in
    a Tandem rollout, the authorship."""
    observation_ids: list[int] = field(default_factory=list)
    """What followed this turn in the next turn's prompt (empty for the last turn)."""
    info: dict[str, Any] = field(default_factory=dict)
    """The callback's `info` for this turn."""
    cached_tokens: int = 0
    """Prompt tokens the engine took from its prefix cache instead of computing them."""


@dataclass
class TrajectoryResult:
    """A trajectory's turns and how it ended; the argument of its callback while it runs."""

    trajectory_id: str
    turns: list[Turn] = field(default_factory=list)
    status: TrajectoryStatus | None = None
    """None while the trajectory runs."""
    error: str = ""
    """Why the callback failed ("callback_error" / "callback_timeout")."""

    @property
    def model_tokens(self) -> int:
        """Tokens the model sampled over all turns (what the token budget counts)."""
        return sum(len(turn.sample.token_ids) for turn in self.turns)

    @property
    def observation_tokens(self) -> int:
        return sum(len(turn.observation_ids) for turn in self.turns)

    @property
    def token_ids(self) -> list[int]:
        """The whole conversation: the first prompt, then each turn's sampled and observation
        ids (the last turn's prompt + its sampled ids)."""
        if not self.turns:
            return []
        last = self.turns[-1]
        return last.prompt_ids + last.sample.token_ids + last.observation_ids


@runtime_checkable
class TrajectoryBackend(Protocol):
    """A generation backend that runs trajectories (both `VLLMBackend` and `HFBackend`)."""

    def generate_trajectories(
        self,
        trajectories: Sequence[Trajectory],
        params: SamplingParams,
        limits: TrajectoryLimits | None = None,
        schedule: WordSwitchSchedule | None = None,
        segments: Segments | None = None,
    ) -> list[TrajectoryResult]:
        """Run every trajectory, results in the order given; `params.max_tokens` bounds each turn,
        `limits` the trajectory, `schedule` makes every turn a Tandem rollout, `segments` samples
        the trajectories' tokens with two policy versions (partial rollouts)."""
        ...

    def iter_trajectories(
        self,
        trajectories: Sequence[Trajectory],
        params: SamplingParams,
        limits: TrajectoryLimits | None = None,
        schedule: WordSwitchSchedule | None = None,
        segments: Segments | None = None,
    ) -> Iterator[tuple[int, TrajectoryResult]]:
        """`generate_trajectories` yielding (index, result) as each trajectory ends; leaving the
        iterator early aborts what is still being sampled."""
        ...


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of turn `turn` of a trajectory seeded `seed`: the seed itself for turn 0, a
    63-bit blake2b hash of (seed, turn) after it; None for an unseeded trajectory."""
    if seed is None or turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:turn:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def reply_error(reply: object, vocab_size: int) -> str:
    """Why `reply` is not a usable turn reply ("" when it is)."""
    if not isinstance(reply, (Continue, Finish)):
        return f"the callback returned {type(reply).__name__}, not Continue or Finish"
    if not isinstance(reply.info, dict):
        return f"the callback's info is a {type(reply.info).__name__}, not a dict"
    if isinstance(reply, Continue):
        ids = reply.observation_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            return f"observation_ids is a {type(ids).__name__}, not a sequence of token ids"
        bad = [
            t
            for t in ids
            if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab_size
        ]
        if bad:
            return f"observation_ids hold {bad[:5]!r}, not token ids in [0, {vocab_size})"
    return ""
