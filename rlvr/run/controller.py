"""Training-time control state owned by the ControllerActor: step counter, per-prompt statistics,
metrics history and recent rollouts. Every update carries its step and is applied at most once.

Pure Python so it is unit-testable and its `state_dict` is plain JSON for durable checkpoints.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rlvr.algorithms.duet.control import DuetController
from rlvr.algorithms.laconic import DualState


class StepOrderError(RuntimeError):
    """An update arrived for a step that is neither the next one nor an already-applied retry."""


@dataclass
class PromptStats:
    """Running statistics of one prompt across the steps it was drawn in."""

    visits: int = 0
    samples: int = 0
    reward_mean: float = 0.0
    last_step: int = -1

    def update(self, rewards: list[float], step: int) -> None:
        total = self.reward_mean * self.samples + sum(rewards)
        self.samples += len(rewards)
        self.visits += 1
        self.reward_mean = total / self.samples if self.samples else 0.0
        self.last_step = step


@dataclass
class TrainingController:
    """Plans each step and absorbs its observations exactly once (retries are no-ops)."""

    group_size: int
    recent_rollouts_cap: int = 256
    last_applied_step: int = -1
    prompts: dict[str, PromptStats] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    recent_rollouts: deque = field(default_factory=deque)
    laconic: DualState | None = None
    duet: DuetController | None = None

    @classmethod
    def build(
        cls,
        group_size: int,
        laconic: dict[str, float] | None = None,
        duet: dict[str, Any] | None = None,
    ) -> TrainingController:
        """A controller with the method states a run's config asks for (`Config.laconic_dual`,
        `Config.duet_controller`), so a checkpoint of that run loads into it."""
        return cls(
            group_size=group_size,
            laconic=DualState(**laconic) if laconic else None,
            duet=DuetController(**duet) if duet else None,
        )

    def plan_step(self, step: int, prompt_ids: list[str]) -> dict[str, Any]:
        """Rollouts per prompt for `step` (fixed group size for GRPO), and the step's dual values.

        LACONIC's lambda is read here, once, before any advantage of the step is computed. With
        DUET the counts come from its allocation and `plan["duet"]` holds the step's plan
        (counts aligned with `prompt_ids`, lambda*, budget, K1/K2, ...).
        """
        if step != self.last_applied_step + 1:
            raise StepOrderError(
                f"plan for step {step} but the next step is {self.last_applied_step + 1}"
            )
        plan: dict[str, Any] = {"step": step, "n": {pid: self.group_size for pid in prompt_ids}}
        if self.laconic is not None:
            plan["laconic_lambda"] = self.laconic.lambda_for_step(step)
        if self.duet is not None:
            plan["duet"] = self.duet.plan(step, prompt_ids)
            plan["n"] = dict(zip(prompt_ids, plan["duet"]["counts"], strict=True))
        return plan

    def update_length_dual(self, step: int, mean_length: float) -> float:
        """LACONIC's dual step from the mean length of ALL the step's responses; once per step."""
        if self.laconic is None:
            raise RuntimeError("LACONIC is not enabled for this run")
        return self.laconic.step_update(step, mean_length)

    def update_duet_state(
        self,
        step: int,
        prompt_ids: list[str],
        advantages: list[float],
        logprob_sums: list[float],
        lengths: list[int],
        kept: list[bool],
        epoch_end: bool = False,
    ) -> dict[str, Any]:
        """DUET's per-prompt state and K1/K2 window from the step's rollouts; once per step."""
        if self.duet is None:
            raise RuntimeError("DUET is not enabled for this run")
        return self.duet.update(
            step, prompt_ids, advantages, logprob_sums, lengths, kept, epoch_end
        )

    def observe_step(
        self,
        step: int,
        rewards_by_prompt: dict[str, list[float]],
        metrics: dict[str, Any],
        rollouts: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Apply the step's observations; returns False (and changes nothing) for a retried step."""
        if step <= self.last_applied_step:
            return False
        if step != self.last_applied_step + 1:
            raise StepOrderError(
                f"observation for step {step} but the next step is {self.last_applied_step + 1}"
            )
        if self.duet is not None and self.duet.last_step != step:
            raise StepOrderError(f"step {step} observed before its DUET state update")
        for pid, rewards in rewards_by_prompt.items():
            self.prompts.setdefault(pid, PromptStats()).update(list(rewards), step)
        self.history.append({"step": step, **metrics})
        for r in rollouts or []:
            self.recent_rollouts.append({"step": step, **r})
            while len(self.recent_rollouts) > self.recent_rollouts_cap:
                self.recent_rollouts.popleft()
        self.last_applied_step = step
        return True

    def summary(self) -> dict[str, Any]:
        """A small live view for notebooks and progress displays."""
        return {
            "last_applied_step": self.last_applied_step,
            "prompts_seen": len(self.prompts),
            "last_metrics": self.history[-1] if self.history else {},
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "group_size": self.group_size,
            "last_applied_step": self.last_applied_step,
            "prompts": {pid: vars(s).copy() for pid, s in self.prompts.items()},
            "history": copy.deepcopy(self.history),
            "recent_rollouts": list(self.recent_rollouts),
            "laconic": self.laconic.state_dict() if self.laconic is not None else None,
            "duet": self.duet.state_dict() if self.duet is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group_size = state["group_size"]
        self.last_applied_step = state["last_applied_step"]
        self.prompts = {pid: PromptStats(**s) for pid, s in state["prompts"].items()}
        self.history = copy.deepcopy(state["history"])
        self.recent_rollouts = deque(state["recent_rollouts"])
        dual = state.get("laconic")
        if (dual is None) != (self.laconic is None):
            raise ValueError("checkpoint and run disagree on whether LACONIC is enabled")
        if dual is not None:
            self.laconic.load_state_dict(dual)
        duet = state.get("duet")
        if (duet is None) != (self.duet is None):
            raise ValueError("checkpoint and run disagree on whether DUET is enabled")
        if duet is not None:
            self.duet.load_state_dict(duet)
