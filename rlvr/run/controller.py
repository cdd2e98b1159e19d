"""Training-time control state owned by the ControllerActor: step counter, per-prompt statistics,
metrics history and recent rollouts. Every update carries its step and is applied at most once.

Pure Python so it is unit-testable and its `state_dict` is plain JSON for durable checkpoints.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rlvr.methods.state import ControllerState


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
    method: ControllerState | None = None
    """The method's own state (`Method.controller_state`): LACONIC's dual, DUET's allocator."""
    method_updated_step: int = -1

    def plan_step(self, step: int, prompt_ids: list[str]) -> dict[str, Any]:
        """Rollouts per prompt for `step` (the fixed group size), with what the method's state
        adds: read here, once, before any advantage of the step is computed (LACONIC's lambda;
        DUET's counts, which replace `n`, and its plan under `plan["duet"]`)."""
        if step != self.last_applied_step + 1:
            raise StepOrderError(
                f"plan for step {step} but the next step is {self.last_applied_step + 1}"
            )
        plan: dict[str, Any] = {"step": step, "n": {pid: self.group_size for pid in prompt_ids}}
        if self.method is not None:
            plan.update(self.method.plan(step, prompt_ids))
        return plan

    def update_method_state(self, step: int, **observation: Any) -> Any:
        """The method state's update from the step's observation; once per step (retries are
        no-ops in the state itself)."""
        if self.method is None:
            raise RuntimeError("this run's method keeps no controller state")
        out = self.method.update(step, **observation)
        self.method_updated_step = max(self.method_updated_step, step)
        return out

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
        method = self.method
        if method is not None and method.updates_every_step and self.method_updated_step != step:
            raise StepOrderError(f"step {step} observed before its method state update")
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
            "method": self.method.state_dict() if self.method is not None else None,
            "method_updated_step": self.method_updated_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group_size = state["group_size"]
        self.last_applied_step = state["last_applied_step"]
        self.prompts = {pid: PromptStats(**s) for pid, s in state["prompts"].items()}
        self.history = copy.deepcopy(state["history"])
        self.recent_rollouts = deque(state["recent_rollouts"])
        method = state.get("method")
        if (method is None) != (self.method is None):
            raise ValueError("checkpoint and run disagree on whether the method keeps state")
        if method is not None:
            self.method.load_state_dict(method)
        self.method_updated_step = state.get("method_updated_step", -1)
