"""ControllerActor: the named owner of training-time control state (`rlvr-controller-<run>`).

A thin shell over `rlvr.run.controller.TrainingController`; being a single actor makes it the only
writer, and every update carries its step so retries are no-ops. Notebooks attach to it by name.
"""

from __future__ import annotations

from typing import Any

from rlvr.methods.state import ControllerState
from rlvr.run.controller import TrainingController

NAMESPACE = "rlvr"


def controller_name(run_name: str) -> str:
    return f"rlvr-controller-{run_name}"


class ControllerActor:
    def __init__(
        self,
        group_size: int,
        method: ControllerState | None = None,
    ):
        self.state = TrainingController(group_size, method=method)

    def plan_step(self, step: int, prompt_ids: list[str]) -> dict[str, Any]:
        return self.state.plan_step(step, prompt_ids)

    def update_method_state(self, step: int, **observation: Any) -> Any:
        return self.state.update_method_state(step, **observation)

    def observe_step(
        self,
        step: int,
        rewards_by_prompt: dict[str, list[float]],
        metrics: dict[str, Any],
        rollouts: list[dict[str, Any]] | None = None,
    ) -> bool:
        return self.state.observe_step(step, rewards_by_prompt, metrics, rollouts)

    def summary(self) -> dict[str, Any]:
        return self.state.summary()

    def history(self) -> list[dict[str, Any]]:
        return self.state.history

    def recent_rollouts(self, limit: int = 50) -> list[dict[str, Any]]:
        return list(self.state.recent_rollouts)[-limit:]

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)
