"""LACONIC's state on the training controller: the dual variable lambda (Eq. 9), read when a step
is planned and stepped once per step from the mean length of all its responses."""

from __future__ import annotations

from typing import Any

from rlvr.algorithms.laconic import DualState


class LaconicState:
    """`ControllerState` over `laconic.DualState` (idempotent per step, as the dual itself)."""

    updates_every_step = False

    def __init__(self, **dual: float) -> None:
        self.dual = DualState(**dual)

    def plan(self, step: int, prompt_ids: list[str]) -> dict[str, Any]:
        return {"laconic_lambda": self.dual.lambda_for_step(step)}

    def update(self, step: int, mean_length: float) -> float:
        """The dual step; returns lambda for the next step."""
        return self.dual.step_update(step, mean_length)

    def state_dict(self) -> dict[str, Any]:
        return self.dual.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dual.load_state_dict(state)
