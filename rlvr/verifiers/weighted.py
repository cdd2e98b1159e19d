"""Several rewards with weights (`verifier.rewards`), after TRL's `reward_funcs`/`reward_weights`.

Each component is a verifier (math, code or a python plug-in) with a name and a weight; an item's
reward is the weighted sum of the components' rewards, and its status is the first component's
(list the check that says whether the answer is right first: math or code, then shaping rewards
such as a format bonus). Each component's reward is returned too, for the step's
`reward/<name>_mean` metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlvr.verifiers.base import ClosingVerifier
from rlvr.verifiers.worker import plugin_name

__all__ = ["Component", "WeightedVerifier", "combine", "reward_name"]


def reward_name(
    kind: str, function: str | Callable[..., Any] | None = None, name: str | None = None
) -> str:
    """A component's name in metrics: `name`, else the function's name (python), else the kind."""
    if name:
        return name
    if kind == "python" and function is not None:
        return plugin_name(function).rpartition(":")[2].rpartition(".")[2]
    return kind


@dataclass(frozen=True)
class Component:
    """One weighted reward: its metrics name, weight and verifier (MathVerifier's interface)."""

    name: str
    weight: float
    verifier: Any


def combine(weights: list[float], scored: list[list[tuple[float, str]]]) -> list[tuple[float, str]]:
    """Per item, the weighted sum of the components' rewards (`scored[c][i]`: component c's
    (reward, status) for item i) and the first component's status."""
    return [
        (sum(w * r for w, (r, _) in zip(weights, item, strict=True)), item[0][1])
        for item in zip(*scored, strict=True)
    ]


class WeightedVerifier(ClosingVerifier):
    """The weighted sum of `components`' rewards. `verify_batch` returns, per item,
    (reward, status, {component name: its reward}); the components score at the same time, each
    within its own timeout."""

    def __init__(self, components: list[Component]):
        if not components:
            raise ValueError("a weighted verifier needs at least one component")
        self.components = components
        self._threads = ThreadPoolExecutor(len(components), thread_name_prefix="weighted-verify")

    def wait_ready(self) -> None:
        for c in self.components:
            c.verifier.wait_ready()

    def verify_batch(
        self,
        responses: list[str],
        golds: list[str],
        timeout: float | None = None,
        prompts: list[str] | None = None,
        metadata: list[dict] | None = None,
    ) -> list[tuple[float, str, dict[str, float]]]:
        """The combined (reward, status) and the components' rewards per item, in input order."""
        scored = list(
            self._threads.map(
                lambda c: c.verifier.verify_batch(
                    responses, golds, timeout=timeout, prompts=prompts, metadata=metadata
                ),
                self.components,
            )
        )
        combined = combine([c.weight for c in self.components], scored)
        names = [c.name for c in self.components]
        return [
            (reward, status, {name: s[i][0] for name, s in zip(names, scored, strict=True)})
            for i, (reward, status) in enumerate(combined)
        ]

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        for c in self.components:
            c.verifier.close()
