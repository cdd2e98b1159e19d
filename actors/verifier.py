"""VerifierActor and the pool that spreads scoring across N of them.

Each actor owns a math verifier whose subprocess pool enforces the per-item timeout. The pool adds a
second, outer deadline: an actor that dies or stops answering yields failed rewards for its items
and is replaced, so a step never hangs on verification.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from rlvr.verifiers.math import MathVerifier

log = logging.getLogger(__name__)

FAILED = (0.0, "error")


class VerifierActor:
    """Scores (response, gold) pairs with the math verifier in this actor's own process pool."""

    def __init__(self, timeout_s: float, num_workers: int = 1):
        self.verifier = MathVerifier(num_workers=num_workers, timeout=timeout_s)
        self.verifier.wait_ready()

    def score(self, responses: list[str], golds: list[str]) -> list[tuple[float, str]]:
        return self.verifier.verify_batch(responses, golds)

    def ping(self) -> bool:
        return True


class VerifierPool:
    """N VerifierActors; `score` splits a batch across them with an outer deadline per chunk."""

    def __init__(
        self, size: int, timeout_s: float, workers_per_actor: int = 1, cpus_per_actor: float = 0.0
    ):
        self.size = size
        self.timeout_s = timeout_s
        self.workers_per_actor = workers_per_actor
        self.cpus_per_actor = cpus_per_actor
        self.replaced = 0
        self.actors = [self._spawn() for _ in range(size)]

    def _spawn(self) -> ray.actor.ActorHandle:
        return (
            ray.remote(VerifierActor)
            .options(num_cpus=self.cpus_per_actor, max_restarts=0)
            .remote(self.timeout_s, self.workers_per_actor)
        )

    def _replace(self, index: int) -> None:
        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self._spawn()
        self.replaced += 1

    def score(self, responses: list[str], golds: list[str]) -> list[tuple[float, str]]:
        """Rewards and statuses in input order; items of a failed actor get (0.0, 'verifier_failed')."""
        if len(responses) != len(golds):
            raise ValueError("responses and golds differ in length")
        n = len(responses)
        chunks = [list(range(i, n, self.size)) for i in range(self.size)]
        futures = {}
        for a, idx in enumerate(chunks):
            if idx:
                futures[a] = self.actors[a].score.remote(
                    [responses[i] for i in idx], [golds[i] for i in idx]
                )
        out: list[tuple[float, str]] = [FAILED] * n
        # Items run concurrently inside an actor across its workers; allow each item its timeout in sequence.
        deadline = (
            time.monotonic() + self.timeout_s * max((len(c) for c in chunks), default=1) + 30.0
        )
        for a, ref in futures.items():
            try:
                results = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                for i, r in zip(chunks[a], results, strict=True):
                    out[i] = (float(r[0]), str(r[1]))
            except (RayActorError, GetTimeoutError) as err:
                log.warning("verifier actor %d failed (%s); replacing it", a, type(err).__name__)
                self._replace(a)
        return out

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
