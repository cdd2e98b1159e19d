"""M generation engines behind the call surface of one generator `Worker`.

A step's requests go to the engines in contiguous, work-balanced shards and come back merged in
request order. Every seed a rollout uses follows from its step-wide position (each request's own
seed, DUET's coin rows through `first_row`), so M engines write exactly the rollouts of one.
Multi-turn trajectories are sharded the same way; each carries its own seed, from which every
turn's follows (`rlvr.generation.trajectories.turn_seed`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import ray

from rlvr.envs.rollout import AgentRequest, EnvSettings
from rlvr.generation.base import GenerationRequest, GenerationResult, SamplingParams
from rlvr.generation.trajectories import Trajectory, TrajectoryLimits, TrajectoryResult
from workflows.workers import FanOut, Worker


def contiguous_shards(costs: Sequence[float], parts: int) -> list[slice]:
    """Cut items into `parts` contiguous slices of about total / parts cost each.

    Cut k falls at the item boundary whose cost prefix is nearest k * total / parts (the earlier
    on a tie, never before cut k - 1); slices may be empty. Contiguous, so a shard's rollouts are
    one run of step-wide rows and DUET's coins need only the shard's first row.
    """
    prefix = list(itertools.accumulate(costs, initial=0))
    cuts = [0]
    for k in range(1, parts):
        target = prefix[-1] * k / parts
        cuts.append(min(range(cuts[-1], len(costs) + 1), key=lambda b: abs(prefix[b] - target)))
    cuts.append(len(costs))
    return [slice(a, b) for a, b in itertools.pairwise(cuts)]


def _concat(shards: list[list[Any]]) -> list[Any]:
    return [item for shard in shards for item in shard]


class GeneratorPool:
    """Drives `workers` (one GeneratorActor each, engine 0 first) as the step code drives one.

    `call(method, ...)` returns a `FanOut`, `get` resolves it, `run` does both; a crashed
    engine raises `ActorFailure` under its Worker's name, so the names must differ
    ("GeneratorActor 0", "GeneratorActor 1", ...). The pool's `weight_version` starts at 0, as
    a fresh GeneratorActor's does, and follows each resolved `update_weights`; `generate` sends
    it along and an engine at another version refuses the call, so no step mixes weights.
    """

    name = "GeneratorPool"

    def __init__(self, workers: list[Worker], sleep_level: int | None = None) -> None:
        """`sleep_level`: vLLM's sleep level while colocated ranks train (None: never sleep)."""
        names = [w.name for w in workers]
        if not workers or len(set(names)) != len(names):
            raise ValueError(f"a GeneratorPool needs engines with distinct names, got {names}")
        self.workers = list(workers)
        self.weight_version = 0
        self.sleep_level = sleep_level
        self.asleep: set[str] = set()
        """What the engines have freed and not taken back ("weights", "kv_cache")."""
        self._methods: dict[str, Callable[..., FanOut]] = {
            "generate": self._generate,
            "generate_trajectories": self._generate_trajectories,
            "generate_agents": self._generate_agents,
            "score_logprobs": self._score_logprobs,
            "update_weights": self._update_weights,
            "begin_partial": self._begin_partial,
            "end_partial": self._end_partial,
            "stats": self._stats,
            "ready": self._ready,
        }

    def call(self, method: str, *args: Any, **kwargs: Any) -> FanOut:
        """Start `method` on the engines that take part; resolve the result with `get`."""
        if method not in self._methods:
            raise AttributeError(f"GeneratorPool has no method {method!r}")
        return self._methods[method](*args, **kwargs)

    def get(self, future: FanOut, step: int | None = None) -> Any:
        """Resolve every engine's part and merge; a crash names the engine and the step."""
        return future.result(step)

    def run(self, method: str, *args: Any, step: int | None = None, **kwargs: Any) -> Any:
        return self.get(self.call(method, *args, **kwargs), step=step)

    # --- typed calls ----------------------------------------------------------------------------
    def ready(self) -> bool:
        """Wait until every engine has loaded the model (a bad model fails here, named)."""
        return self.run("ready")

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        duet_stop: dict[str, Any] | None = None,
        tandem: bool = False,
        step: int | None = None,
    ) -> list[GenerationResult]:
        """Results in request order, the requests split over the engines."""
        return self.run("generate", requests, params, duet_stop=duet_stop, tandem=tandem, step=step)

    def generate_trajectories(
        self,
        trajectories: Sequence[Trajectory],
        params: SamplingParams,
        limits: TrajectoryLimits | None = None,
        tandem: bool = False,
        step: int | None = None,
    ) -> list[TrajectoryResult]:
        """Multi-turn results in trajectory order, the trajectories split over the engines."""
        return self.run(
            "generate_trajectories", trajectories, params, limits, tandem=tandem, step=step
        )

    def generate_agents(
        self,
        requests: Sequence[AgentRequest],
        params: SamplingParams,
        env: EnvSettings,
        step: int | None = None,
    ) -> list[GenerationResult]:
        """Multi-turn rollouts in an environment, one result per trajectory in request order, the
        requests split over the engines (each trajectory's seed is its request's, so the split
        changes no token)."""
        return self.run("generate_agents", requests, params, env, step=step)

    def score_logprobs(
        self, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> FanOut:
        """Teacher-forced log-probs at `positions` under the engines' weights (in flight)."""
        return self.call("score_logprobs", sequences, positions)

    def sleep(self, step: int | None = None) -> None:
        """Free the engines' device memory for their colocated ranks' update (no-op unless the
        pool was given a sleep level)."""
        if self.sleep_level is None or self.asleep:
            return
        FanOut([(w, w.call("sleep", self.sleep_level)) for w in self.workers]).result(step)
        self.asleep = {"weights", "kv_cache"}

    def wake(self, tag: str, step: int | None = None) -> None:
        """Take back the memory `sleep` freed under ``tag``: "weights" before a weight load (so
        the KV cache is not yet competing with the sync), then "kv_cache" before generating."""
        if tag not in self.asleep:
            return
        FanOut([(w, w.call("wake_up", [tag])) for w in self.workers]).result(step)
        self.asleep.discard(tag)

    def stats(self) -> dict[str, Any]:
        """The engines' token and time counters, summed, with each engine's beside them."""
        return self.run("stats")

    def _generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        duet_stop: dict[str, Any] | None = None,
        tandem: bool = False,
    ) -> FanOut:
        """Shards balanced on estimated work, n x (prompt length + max_tokens) per request."""
        costs = [r.n * (len(r.prompt_ids) + params.max_tokens) for r in requests]
        row = 0 if duet_stop is None else duet_stop.get("first_row", 0)
        parts = []
        for i, shard in enumerate(contiguous_shards(costs, len(self.workers))):
            chunk = requests[shard]
            if chunk:
                stop = None if duet_stop is None else {**duet_stop, "first_row": row}
                future = self.workers[i].call(
                    "generate",
                    chunk,
                    params,
                    duet_stop=stop,
                    tandem=tandem,
                    weight_version=self.weight_version,
                )
                parts.append((self.workers[i], future))
            row += sum(r.n for r in chunk)
        return FanOut(parts, _concat)

    def _generate_trajectories(
        self,
        trajectories: Sequence[Trajectory],
        params: SamplingParams,
        limits: TrajectoryLimits | None = None,
        tandem: bool = False,
    ) -> FanOut:
        """Shards balanced on estimated work: first prompt + max_tokens per allowed turn."""
        turns = 1 if limits is None or limits.max_turns is None else limits.max_turns
        costs = [len(t.prompt_ids) + params.max_tokens * turns for t in trajectories]
        parts = [
            (
                self.workers[i],
                self.workers[i].call(
                    "generate_trajectories",
                    trajectories[shard],
                    params,
                    limits,
                    tandem=tandem,
                    weight_version=self.weight_version,
                ),
            )
            for i, shard in enumerate(contiguous_shards(costs, len(self.workers)))
            if shard.stop > shard.start
        ]
        return FanOut(parts, _concat)

    def _generate_agents(
        self, requests: Sequence[AgentRequest], params: SamplingParams, env: EnvSettings
    ) -> FanOut:
        """Shards balanced on n x max_tokens per allowed turn (prompts are rendered where the
        environments run)."""
        costs = [r.n * params.max_tokens * env.max_turns for r in requests]
        parts = [
            (
                self.workers[i],
                self.workers[i].call(
                    "generate_agents",
                    requests[shard],
                    params,
                    env,
                    weight_version=self.weight_version,
                ),
            )
            for i, shard in enumerate(contiguous_shards(costs, len(self.workers)))
            if shard.stop > shard.start
        ]
        return FanOut(parts, _concat)

    def _score_logprobs(
        self, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> FanOut:
        """Shards balanced on sequence length (one prefill each)."""
        shards = contiguous_shards([len(q) for q in sequences], len(self.workers))
        parts = [
            (
                self.workers[i],
                self.workers[i].call("score_logprobs", sequences[shard], positions[shard]),
            )
            for i, shard in enumerate(shards)
            if shard.stop > shard.start
        ]
        return FanOut(parts, _concat)

    def _update_weights(self, named_tensors: Any) -> FanOut:
        """Every engine loads the same weights: a dict goes into the object store once, and every
        actor engine reads that one copy; an ObjectRef (the policy's export) is passed as is."""
        shared = named_tensors
        if isinstance(named_tensors, dict) and any(w.is_actor for w in self.workers):
            shared = ray.put(named_tensors)
        parts = [
            (w, w.call("update_weights", shared if w.is_actor else named_tensors))
            for w in self.workers
        ]
        return FanOut(parts, self._adopt_version)

    def _begin_partial(self, tokens: int, versions: tuple[int, int], board: Any) -> FanOut:
        """Every engine samples partial rollouts until `end_partial` (`GeneratorActor`)."""
        parts = [(w, w.call("begin_partial", tokens, versions, board)) for w in self.workers]
        return FanOut(parts, lambda answers: None)

    def _end_partial(self) -> FanOut:
        """Every engine ends partial rollouts on their second version; adopts the engines' one
        weight version and returns the longest an engine waited for versions (seconds)."""
        parts = [(w, w.call("end_partial")) for w in self.workers]
        return FanOut(parts, self._merge_partial)

    def _merge_partial(self, ends: list[dict[str, float]]) -> float:
        self._adopt_version([int(end["version"]) for end in ends])
        return max(end["wait_s"] for end in ends)

    def _adopt_version(self, versions: list[int]) -> int:
        self.weight_version = self._common_version(versions)
        return self.weight_version

    def _common_version(self, versions: list[int]) -> int:
        """The engines' one weight version; raises when they disagree."""
        if len(set(versions)) != 1:
            held = ", ".join(f"{w.name}: {v}" for w, v in zip(self.workers, versions, strict=True))
            raise RuntimeError(f"generation engines disagree on their weight version ({held})")
        return versions[0]

    def _stats(self) -> FanOut:
        parts = [(w, w.call("stats")) for w in self.workers]
        return FanOut(parts, self._merge_stats)

    def _merge_stats(self, stats: list[dict[str, float]]) -> dict[str, Any]:
        """Tokens and busy seconds summed; tokens_per_s is the engines' rates summed (they run
        side by side); the per-engine figures under "engines"."""
        return {
            "tokens": sum(s["tokens"] for s in stats),
            "seconds": sum(s["seconds"] for s in stats),
            "tokens_per_s": sum(s["tokens_per_s"] for s in stats),
            "weight_version": self._common_version([s["weight_version"] for s in stats]),
            "engines": stats,
        }

    def _ready(self) -> FanOut:
        return FanOut([(w, w.call("ready")) for w in self.workers], all)
