"""ControllerActor: the named owner of training-time control state (`rlvr-controller-<run>`).

A thin shell over `rlvr.run.controller.TrainingController`; being a single actor makes it the only
writer, and every update carries its step so retries are no-ops. Notebooks attach to it by name.
"""

from __future__ import annotations

from typing import Any

from rlvr.methods.state import ControllerState
from rlvr.run.controller import TrainingController
from rlvr.serving.stream_host import CSAStreamHost, StreamSpec

NAMESPACE = "rlvr"


def controller_name(run_name: str) -> str:
    return f"rlvr-controller-{run_name}"


class ControllerActor:
    def __init__(
        self,
        group_size: int,
        method: ControllerState | None = None,
        csa_dir: str | None = None,
    ):
        self.state = TrainingController(group_size, method=method)
        # Served CSA streams, restored from csa_dir on every (re)start of this actor.
        self.csa = CSAStreamHost(csa_dir) if csa_dir else None

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

    # CSA streams (rlvr.serving.stream_host): this actor is their only writer, so seq order is the filtration.

    def _csa(self) -> CSAStreamHost:
        if self.csa is None:
            raise RuntimeError(
                "this ControllerActor hosts no CSA streams (started without csa_dir)"
            )
        return self.csa

    def csa_open(
        self, name: str, spec: dict[str, Any], policy: str | None = None, scorer: str | None = None
    ) -> dict[str, Any]:
        return self._csa().open_stream(name, StreamSpec.from_dict(spec), policy, scorer)

    def csa_decide(
        self,
        name: str,
        score: float,
        source: str = "feedback",
        policy: str | None = None,
        experience: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return self._csa().decide(name, score, source, policy, experience)

    def csa_observe(
        self, name: str, seq: int, passed: bool, source: str = "feedback"
    ) -> dict[str, Any]:
        return self._csa().observe(name, seq, passed, source)

    def csa_switch_versions(
        self,
        name: str,
        policy: str | None = None,
        scorer: str | None = None,
        trained_through: int | None = None,
    ) -> int:
        return self._csa().switch_versions(name, policy, scorer, trained_through)

    def csa_publish(self, policy: str, trained_through: int, source: str) -> dict[str, int]:
        return self._csa().publish(policy, trained_through, source)

    def csa_versions(self, name: str) -> dict[str, str | None]:
        return self._csa().versions(name)

    def csa_closed_round(self, name: str, first: int, end: int) -> dict[str, Any] | None:
        return self._csa().closed_round(name, first, end)

    def csa_status(self, name: str | None = None) -> dict[str, Any]:
        host = self._csa()
        names = host.stream_names() if name is None else [name]
        return {n: host.status(n) for n in names}

    def csa_state(self, name: str) -> dict[str, Any]:
        return self._csa().state(name)
