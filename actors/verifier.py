"""VerifierActor and the pool that spreads scoring across N of them.

Each actor owns a verifier of the configured kind (math: a math-verify subprocess pool; code: a
sandbox per item; python: a reward plug-in in worker processes; or several with weights) that
enforces the per-item timeout: an item too slow to score scores (0.0, "timeout"), a verdict like
any other. The pool adds a second, outer deadline: an actor that dies or stops answering is
replaced and its items are scored again, each alone, on the live actors. Scoring is a pure
function of the item (a plug-in must be one too), so a verifier crash changes nothing in the
result; only an item that takes its actor down on every run (1 + MAX_RERUNS) ends with the pool's
failure status, VERIFIER_FAILED, which the step loop counts and caps
(`verifier.max_uncomputed_share`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from rlvr.verifiers import VERIFIER_FAILED
from rlvr.verifiers.factory import make_verifier

log = logging.getLogger(__name__)

Scored = tuple[float, str] | tuple[float, str, dict[str, float]]
"""An item's (reward, status), and with `verifier.rewards` each component's reward by name."""
FAILED: Scored = (0.0, VERIFIER_FAILED)
MAX_RERUNS = 2
"""How many times an item is run again after its actor died or hung. A crash that has nothing to
do with the item (a lost node, the OOM killer) costs it one re-run; the second allows for the
replacement failing too (say, while it starts on a busy machine). An item that still takes its
actor down is a pathological input: it is given up on rather than killing actors for ever."""
DEADLINE_SLACK_S = 30.0
"""Outer deadline beyond the items' own timeouts: Ray's scheduling and a replacement's start."""


class VerifierActor:
    """Scores responses against their golds (and prompts and metadata, which plug-ins read) with
    the verifier `make_verifier(kind, num_workers, timeout_s, function, rewards,
    unsafe_hook_sandbox)` in this actor's own worker processes. A reward function given as an
    object (not its name) arrives here by Ray's serialization, as any actor argument does."""

    def __init__(
        self,
        timeout_s: float,
        num_workers: int = 1,
        kind: str = "math",
        function: str | Callable[..., Any] | None = None,
        rewards: Sequence[Mapping[str, Any]] = (),
        unsafe_hook_sandbox: bool = False,
    ):
        self.verifier = make_verifier(
            kind, num_workers, timeout_s, function, rewards, unsafe_hook_sandbox
        )
        self.verifier.wait_ready()

    def score(
        self,
        responses: list[str],
        golds: list[str],
        prompts: list[str] | None = None,
        metadata: list[dict] | None = None,
    ) -> list[Scored]:
        return self.verifier.verify_batch(responses, golds, prompts=prompts, metadata=metadata)

    def ping(self) -> bool:
        return True


class VerifierPool:
    """N VerifierActors; `score` splits a batch across them with an outer deadline per chunk and
    re-runs the items of an actor that fails (`replaced` counts the actors replaced)."""

    actor_class: type[VerifierActor] = VerifierActor
    """The actor the pool starts (a subclass may score differently)."""

    def __init__(
        self,
        size: int,
        timeout_s: float,
        workers_per_actor: int = 1,
        cpus_per_actor: float = 0.0,
        kind: str = "math",
        function: str | Callable[..., Any] | None = None,
        rewards: Sequence[Mapping[str, Any]] = (),
        unsafe_hook_sandbox: bool = False,
    ):
        self.size = size
        self.kind = kind
        self.function = function
        self.rewards = [dict(r) for r in rewards]
        self.unsafe_hook_sandbox = unsafe_hook_sandbox
        self.timeout_s = timeout_s
        self.workers_per_actor = workers_per_actor
        self.cpus_per_actor = cpus_per_actor
        self.replaced = 0
        self.actors = [self._spawn() for _ in range(size)]

    def _spawn(self) -> ray.actor.ActorHandle:
        return (
            ray.remote(self.actor_class)
            .options(num_cpus=self.cpus_per_actor, max_restarts=0)
            .remote(
                self.timeout_s,
                self.workers_per_actor,
                self.kind,
                self.function,
                self.rewards,
                self.unsafe_hook_sandbox,
            )
        )

    def _replace(self, index: int) -> None:
        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self._spawn()
        self.replaced += 1

    def score(
        self,
        responses: list[str],
        golds: list[str],
        prompts: list[str] | None = None,
        metadata: list[dict] | None = None,
    ) -> list[Scored]:
        """Rewards and statuses in input order, as an uninterrupted pool gives them: the items of
        an actor that dies or misses the deadline are run again, each alone, up to MAX_RERUNS
        times; an item that fails every run gets (0.0, 'verifier_failed'). `prompts` and
        `metadata` (one dict per item) reach plug-ins; without them they see "" and {}."""
        n = len(responses)
        items = {
            "responses": responses,
            "golds": golds,
            "prompts": [""] * n if prompts is None else prompts,
            "metadata": [{} for _ in range(n)] if metadata is None else metadata,
        }
        if any(len(v) != n for v in items.values()):
            raise ValueError("responses, golds, prompts and metadata differ in length")
        out: list[Scored] = [FAILED] * n  # what an item never scored keeps
        failed = self._run([list(range(a, n, self.size)) for a in range(self.size)], items, out)
        for _ in range(MAX_RERUNS):
            # One item per actor at a time: an actor's death is then the fault of its one item.
            waves = [failed[k : k + self.size] for k in range(0, len(failed), self.size)]
            failed = [i for wave in waves for i in self._run([[i] for i in wave], items, out)]
        if failed:
            log.warning(
                "verifier: %d items failed %d runs each; they score %s",
                len(failed),
                1 + MAX_RERUNS,
                FAILED,
            )
        return out

    def _run(
        self, chunks: list[list[int]], items: dict[str, list[Any]], out: list[Scored]
    ) -> list[int]:
        """Score chunk a of item indices on actor a into `out`; returns the items of the chunks
        whose actor died or missed the deadline (each such actor is replaced)."""
        refs = {
            a: self.actors[a].score.remote(*([v[i] for i in idx] for v in items.values()))
            for a, idx in enumerate(chunks)
            if idx
        }
        # Items run concurrently inside an actor across its workers; allow each item its timeout
        # in sequence.
        longest = max((len(c) for c in chunks), default=1)
        deadline = time.monotonic() + self.timeout_s * longest + DEADLINE_SLACK_S
        failed: list[int] = []
        for a, ref in refs.items():
            try:
                results = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except (RayActorError, GetTimeoutError) as err:
                log.warning(
                    "verifier actor %d failed (%s) on %d items; replacing it and re-running them",
                    a,
                    type(err).__name__,
                    len(chunks[a]),
                )
                self._replace(a)
                failed += chunks[a]
                continue
            for i, r in zip(chunks[a], results, strict=True):
                out[i] = (float(r[0]), str(r[1]), *r[2:])
        return failed

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
