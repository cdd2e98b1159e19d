"""What a method keeps on the training controller, as a protocol the controller process can import
without the rest of the library (it stays free of torch)."""

from __future__ import annotations

from typing import Any, Protocol


class ControllerState(Protocol):
    """A method's state on the training controller (`Method.controller_state`): it adds to each
    step's plan (a "n" entry replaces the fixed group size per prompt), is updated once per step
    from what the step saw (`StepServices.update_method_state`) and is checkpointed with the
    controller. Updates must be idempotent per step: a retried step repeats them."""

    updates_every_step: bool
    """Whether each step must update it before the step is observed."""

    def plan(self, step: int, prompt_ids: list[str]) -> dict[str, Any]: ...

    def update(self, step: int, **observation: Any) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
