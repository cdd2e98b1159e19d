"""DUET's state on the training controller: the per-prompt surrogates, lambda* and the K1/K2
window (`duet.control.DuetController`), which plan each step's counts and are updated once per
step from its rollouts before the step is observed."""

from __future__ import annotations

from typing import Any

from rlvr.algorithms.duet.control import DuetController


class DuetState:
    """`ControllerState` over `DuetController`: the plan's per-prompt counts become the step's
    `n`, and its full plan is `plan["duet"]`."""

    updates_every_step = True

    def __init__(self, **settings: Any) -> None:
        self.controller = DuetController(**settings)

    def plan(self, step: int, prompt_ids: list[str]) -> dict[str, Any]:
        plan = self.controller.plan(step, prompt_ids)
        return {"duet": plan, "n": dict(zip(prompt_ids, plan["counts"], strict=True))}

    def update(
        self,
        step: int,
        prompt_ids: list[str],
        advantages: list[float],
        logprob_sums: list[float],
        lengths: list[int],
        kept: list[bool],
        epoch_end: bool = False,
    ) -> dict[str, Any]:
        """Fold the step's rollouts in (once per step); returns DUET's state metrics."""
        return self.controller.update(
            step, prompt_ids, advantages, logprob_sums, lengths, kept, epoch_end
        )

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)
