"""One call surface over Ray actors or in-process objects, so the same step code drives both.

`bench/step_breakdown.py` runs a step through actors and in one process with identical code; the
difference is the actor layer's overhead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray


class Worker:
    """Wraps an actor handle or a plain object; `call` returns a future-like, `get` resolves it."""

    def __init__(self, target: Any, name: str):
        self.target = target
        self.name = name
        self.is_actor = isinstance(target, ray.actor.ActorHandle)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.is_actor:
            return getattr(self.target, method).remote(*args, **kwargs)
        return getattr(self.target, method)(*args, **kwargs)

    def get(self, future: Any, step: int | None = None) -> Any:
        """Resolve a result; an actor crash surfaces as one error naming the actor and the step."""
        if not self.is_actor:
            return future
        try:
            return ray.get(future)
        except ray.exceptions.RayError as err:
            where = f" at step {step}" if step is not None else ""
            raise ActorFailure(
                f"{self.name} failed{where}: {_root_cause(err)}", lost=is_lost(err)
            ) from err

    def run(self, method: str, *args: Any, step: int | None = None, **kwargs: Any) -> Any:
        return self.get(self.call(method, *args, **kwargs), step=step)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> FanOut:
        """`call` as a `FanOut` of one, for typed clients that hand out calls in flight."""
        return FanOut([(self, self.call(method, *args, **kwargs))])


class ActorFailure(RuntimeError):
    """A crash inside an actor, reported with the actor's name and the step; `lost` when the
    actor (or its node, or an object it held) is gone rather than the call raising: restarting
    the actor then fixes it, while an error raised by the call would only repeat."""

    def __init__(self, message: str, lost: bool = False):
        super().__init__(message)
        self.lost = lost


def is_lost(err: BaseException) -> bool:
    """Whether a Ray error means a dead actor, node or object (not an exception in the call)."""
    return isinstance(err, ray.exceptions.RayActorError | ray.exceptions.ObjectLostError)


def _root_cause(err: BaseException) -> str:
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__


@dataclass
class FanOut:
    """One call in flight on one or more workers: each worker's future, and how to merge their
    answers into the caller's result. `result` waits; a crash names the worker and the step."""

    parts: list[tuple[Worker, Any]]
    merge: Callable[[list[Any]], Any] = field(default=lambda answers: answers[0])

    def result(self, step: int | None = None) -> Any:
        return self.merge([worker.get(future, step=step) for worker, future in self.parts])
