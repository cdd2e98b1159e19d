"""StreamsActor: the named owner of a deployment's CSA streams (`rlvr-streams-<deployment>`).

A thin shell over `rlvr.serving.stream_host.CSAStreamHost` (arXiv:2605.20270, Algorithms 1-2):
being the single writer of every stream makes seq order the filtration, whatever the number of
replicas. Its state is durable under `state_dir`, restored on every (re)start of the actor.
"""

from __future__ import annotations

from typing import Any

from rlvr.serving.stream_host import CSAStreamHost, StreamSpec


def streams_name(deployment: str) -> str:
    return f"rlvr-streams-{deployment}"


class StreamsActor:
    def __init__(self, state_dir: str):
        self.host = CSAStreamHost(state_dir)

    def open(
        self, name: str, spec: dict[str, Any], policy: str | None = None, scorer: str | None = None
    ) -> dict[str, Any]:
        return self.host.open_stream(name, StreamSpec.from_dict(spec), policy, scorer)

    def decide(
        self,
        name: str,
        score: float,
        source: str = "feedback",
        policy: str | None = None,
        experience: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return self.host.decide(name, score, source, policy, experience)

    def observe(
        self, name: str, seq: int, passed: bool, source: str = "feedback"
    ) -> dict[str, Any]:
        return self.host.observe(name, seq, passed, source)

    def publish(self, policy: str, trained_through: int, source: str) -> dict[str, int]:
        return self.host.publish(policy, trained_through, source)

    def versions(self, name: str) -> dict[str, str | None]:
        return self.host.versions(name)

    def closed_round(self, name: str, first: int, end: int) -> dict[str, Any] | None:
        return self.host.closed_round(name, first, end)

    def status(self, name: str | None = None) -> dict[str, Any]:
        names = self.host.stream_names() if name is None else [name]
        return {n: self.host.status(n) for n in names}

    def state(self, name: str) -> dict[str, Any]:
        return self.host.state(name)
