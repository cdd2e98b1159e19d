"""GeneratorActor: owns a generation backend (vLLM by default, transformers as fallback).

Receives new weights after every training step through `update_weights` (named tensors via the
object store on CPU) and keeps a running tokens/s figure. DUET's stop rule is built here from plain
settings, because it decodes with this process's tokenizer (a decode function does not travel).
In Tandem mode it also holds the frozen junior (in the same engine, or, in the separate form, a
companion GeneratorActor of its own that writes the junior's segments) and the word-switch
schedule built from this process's tokenizer; `update_weights` reaches the senior only.
Multi-turn rollouts (`generate_trajectories`) run on the backend's engine loop, their turn
callbacks in this process. Between `begin_partial` and `end_partial` every call samples partial
rollouts: each trajectory's first tokens with one policy version, the rest with the next, which
the engine fetches from the pipeline's `VersionBoard` and loads between decode steps
(`rlvr.generation.segments`).
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
import torch

from actors.versions import fetch_snapshot
from rlvr.algorithms.duet.stop import StopControllerFactory
from rlvr.algorithms.tandem import JUNIOR, SENIOR, WordSwitchSchedule, word_boundary_ids
from rlvr.envs.rollout import AgentRequest, Agents, EnvSettings
from rlvr.generation import make_backend
from rlvr.generation.base import (
    EngineLoop,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StopRuleFactory,
)
from rlvr.generation.segments import Segments
from rlvr.generation.tandem_separate import (
    Handoff,
    SegmentWriter,
    cowrite,
    cowrite_continuous,
    ready,
)
from rlvr.generation.tandem_support import check_same_tokenizer
from rlvr.generation.trajectories import Trajectory, TrajectoryLimits, TrajectoryResult
from rlvr.memory import pin_mmap_threshold, release_free_heap
from rlvr.training import weight_sync
from rlvr.training.rendezvous import bind_collectives

PUMPS_IN_FLIGHT = 2
"""`pump_segments` calls a senior keeps queued at its companion junior."""


class CompanionSegments:
    """A companion junior's engine as a `SegmentEngine`, driven through its `pump_segments`.
    Two calls are kept in flight: the actor runs them one by one, so the second starts the
    moment the first returns and the junior never waits for this process's engine step; the
    segments added meanwhile go with the next call. An in-process companion is pumped within
    `step`."""

    def __init__(self, companion: Any, params: SamplingParams, stop_token_ids: list[int]) -> None:
        self.companion = companion
        self.params = params
        self.stop_token_ids = stop_token_ids
        self.call = uuid.uuid4().hex
        self._remote = isinstance(companion, ray.actor.ActorHandle)
        self._outbox: list[Handoff] = []
        self._pending: collections.deque[ray.ObjectRef] = collections.deque()
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def add(self, handoffs: list[Handoff]) -> None:
        self._outbox += handoffs
        self._live += len(handoffs)
        if self._remote:
            self._send()

    def step(self, wait: bool = True) -> list[Handoff]:
        if not self._remote:
            outbox, self._outbox = self._outbox, []
            written = self._pump(outbox)
        elif not self._pending:
            written = []
        else:
            ready, _ = ray.wait([self._pending[0]], timeout=None if wait else 0)
            written = ray.get(self._pending.popleft()) if ready else []
        self._live -= len(written)
        if self._remote:
            self._send()
        return written

    def _send(self) -> None:
        while self._live and len(self._pending) < PUMPS_IN_FLIGHT:
            outbox, self._outbox = self._outbox, []
            self._pending.append(self._pump(outbox))

    def _pump(self, handoffs: list[Handoff]) -> Any:
        pump = self.companion.pump_segments
        args = (self.call, handoffs, self.params, self.stop_token_ids)
        return pump.remote(*args) if self._remote else pump(*args)


class GeneratorActor:
    def __init__(
        self,
        backend: str,
        model_path: str,
        threads: int,
        tandem: dict[str, Any] | None = None,
        address: str | None = None,
        mmap_threshold_kib: int = 0,
        companion: Any = None,
        **backend_kwargs: Any,
    ):
        """`tandem` ({"junior_path", "p", "cap", "junior"}) starts the engine with Tandem's
        junior: inside this engine ("junior": "shared", the default), or in `companion`, the
        junior's own GeneratorActor (an actor handle or an object in this process), for
        "junior": "separate". A companion itself is started on the junior's weights with
        {"p", "cap", "role": "junior"} and only writes the junior's segments (`write_segments`).
        `address`: where the engine's gloo / NCCL groups and the weight group listen (None: they
        choose). `mmap_threshold_kib`: see `pin_mmap_threshold` (0: glibc's default)."""
        if mmap_threshold_kib:
            pin_mmap_threshold(mmap_threshold_kib << 10)
        torch.set_num_threads(threads)
        if address is not None:
            bind_collectives(address)
        self.role = SENIOR
        self.companion = None
        if tandem is not None and tandem.get("role") == "junior":
            self.role = JUNIOR
        elif tandem is not None and tandem.get("junior") == "separate":
            if companion is None:
                raise ValueError("a separate Tandem junior needs its engine (companion)")
            check_same_tokenizer(model_path, tandem["junior_path"])
            self.companion = companion
        elif tandem is not None:
            backend_kwargs["junior_path"] = tandem["junior_path"]
        if backend == "vllm" and (self.role == JUNIOR or self.companion is not None):
            backend_kwargs["tandem_segments"] = True
        self.backend = make_backend(backend, model_path, **backend_kwargs)
        self.schedule: WordSwitchSchedule | None = None
        if tandem is not None:
            boundary = word_boundary_ids(self.backend.tokenizer.get_vocab())
            self.schedule = WordSwitchSchedule(boundary, p=tandem["p"], cap=tandem["cap"])
        self.tokens = 0
        self.seconds = 0.0
        self.weight_version = 0
        self.max_model_len: int | None = backend_kwargs.get("max_model_len")
        self._agents: Agents | None = None
        self._partial: tuple[int, tuple[int, int], Any] | None = None
        """(tokens, versions, board) of partial rollouts in progress."""
        self._holding: int | None = None
        """The policy version loaded, while partial rollouts are in progress."""
        self._waited = self._wait_counted = 0.0
        """Seconds the current partial rollouts spent waiting for and loading a version, and
        the part of them already left out of a call's generation time."""
        self._stream: tuple[str, Any, dict[int, int]] | None = None
        """A companion junior's segments of a continuous hand-over: (call, its segment stream,
        each live sample's response length when it arrived)."""

    def ready(self) -> bool:
        return True

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        stop_rule_factory: StopRuleFactory | None = None,
        duet_stop: dict[str, Any] | None = None,
        tandem: bool = False,
        weight_version: int | None = None,
        loop: EngineLoop | None = None,
    ) -> list[GenerationResult]:
        """Sample every request; `duet_stop` (the settings of a `StopControllerFactory` but the
        decode function and request sizes; `first_row` when these requests continue a step
        split over engines) runs DUET's stop rule on every sample in the engine; `tandem`
        co-writes every sample with the junior (authorship in `Sample.authorship`).
        `weight_version`, when given, must be this engine's: a step never mixes weights.
        `loop` overrides a vLLM engine's `engine_loop` for this call."""
        schedule = self._checked(tandem, weight_version)
        if duet_stop is not None:
            if stop_rule_factory is not None:
                raise ValueError("pass either stop_rule_factory or duet_stop, not both")
            stop_rule_factory = StopControllerFactory(
                decode=self._decode, request_sizes=[r.n for r in requests], **duet_stop
            )
        t = time.perf_counter()
        if schedule is not None and self.companion is not None:
            if stop_rule_factory is not None:
                raise ValueError("stop rules and tandem generation cannot be combined")
            results = self._cowrite(requests, params, schedule)
        else:
            kwargs: dict[str, Any] = {} if loop is None else {"loop": loop}
            if self._partial is not None:
                kwargs["segments"] = self._segments()
            results = self.backend.generate(
                requests, params, stop_rule_factory, schedule=schedule, **kwargs
            )
        self._count(t, sum(len(s.token_ids) for r in results for s in r.samples))
        return results

    def generate_trajectories(
        self,
        trajectories: Sequence[Trajectory],
        params: SamplingParams,
        limits: TrajectoryLimits | None = None,
        tandem: bool = False,
        weight_version: int | None = None,
    ) -> list[TrajectoryResult]:
        """Run multi-turn rollouts (`rlvr.generation.trajectories`) on this engine; their turn
        callbacks run in this process. `tandem` and `weight_version` as in `generate`."""
        schedule = self._checked(tandem, weight_version)
        if schedule is not None and self.companion is not None:
            raise ValueError("a separate Tandem junior co-writes single-turn samples only")
        t = time.perf_counter()
        results = self.backend.generate_trajectories(
            trajectories, params, limits, schedule, self._segments()
        )
        self._count(t, sum(r.model_tokens for r in results))
        return results

    def generate_agents(
        self,
        requests: Sequence[AgentRequest],
        params: SamplingParams,
        env: EnvSettings,
        weight_version: int | None = None,
    ) -> list[GenerationResult]:
        """Multi-turn rollouts in an environment (`rlvr.envs.rollout`): one result per
        trajectory; the environments (tools in their sandboxes, a user class in a process of its
        own) run beside this engine."""
        self._checked(False, weight_version)
        if self._agents is None or self._agents.settings != env:
            self._agents = Agents(env, self.backend.tokenizer)
        t = time.perf_counter()
        results = self._agents.generate(
            self.backend, requests, params, self.max_model_len, segments=self._segments()
        )
        tokens = sum(sum(s.model_tokens or ()) for r in results for s in r.samples)
        self._count(t, tokens)
        return results

    def _checked(self, tandem: bool, weight_version: int | None) -> WordSwitchSchedule | None:
        """The Tandem schedule of a call (None: solo), once the call's weights are this engine's."""
        if weight_version is not None and weight_version != self.weight_version:
            raise ValueError(
                f"engine at weight version {self.weight_version}, the step expects {weight_version}"
            )
        if tandem and (self.schedule is None or self.role != SENIOR):
            raise ValueError("tandem generation needs a GeneratorActor started with a junior")
        if tandem and self._partial is not None:
            raise ValueError("tandem generation cannot be sampled as partial rollouts")
        return self.schedule if tandem else None

    def begin_partial(self, tokens: int, versions: tuple[int, int], board: Any) -> None:
        """Sample every later call as partial rollouts: each trajectory's first `tokens` model
        tokens with policy `versions[0]` (the weights this engine holds now), the rest with
        `versions[1]`, fetched from `board` (`actors.versions.VersionBoard`) when needed."""
        self._partial = (tokens, versions, board)
        self._holding = versions[0]
        self._waited = self._wait_counted = 0.0

    def end_partial(self) -> dict[str, float]:
        """End partial rollouts holding their second version (what the next batch starts from,
        and the same on every engine whether or not its trajectories reached it); returns the
        weight version, one up when the weights changed, and the seconds the calls waited for
        and loaded versions (`wait_s`: part of their time, none of their generation)."""
        if self._partial is None:
            raise RuntimeError("end_partial without begin_partial")
        first, last = self._partial[1]
        try:
            self._hold(last)
        finally:  # a closed board (the run stopping) ends partial rollouts too
            self._partial, self._holding = None, None
        if last != first:
            self.weight_version += 1
        return {"version": self.weight_version, "wait_s": self._waited}

    def _segments(self) -> Segments | None:
        if self._partial is None:
            return None
        tokens, versions, _ = self._partial
        return Segments(tokens, versions, self._hold)

    def _hold(self, version: int) -> None:
        """Load policy `version` from the board unless it is loaded (no request is running)."""
        assert self._partial is not None
        if self._holding != version:
            start = time.perf_counter()
            weights = fetch_snapshot(self._partial[2], version)
            self.backend.load_weights(weights.items())
            del weights
            release_free_heap()
            self._holding = version
            self._waited += time.perf_counter() - start

    def write_segments(
        self, handoffs: list[Handoff], params: SamplingParams, stop_token_ids: list[int]
    ) -> list[Handoff]:
        """A companion junior's turn: continue each sample until the senior's next token or its
        end (`rlvr.generation.tandem_separate`); `stop_token_ids` are the senior's."""
        if self.role != JUNIOR:
            raise ValueError("write_segments runs on a Tandem junior's own engine only")
        t = time.perf_counter()
        before = sum(len(h.response_ids) for h in handoffs)
        written = self.backend.write_segments(
            handoffs, params, self.schedule, JUNIOR, stop_token_ids
        )
        self.seconds += time.perf_counter() - t
        self.tokens += sum(len(h.response_ids) for h in written) - before
        return written

    def pump_segments(
        self, call: str, handoffs: list[Handoff], params: SamplingParams, stop_token_ids: list[int]
    ) -> list[Handoff]:
        """A companion junior's part of a continuous hand-over (`cowrite_continuous`): add
        `handoffs` to call `call`'s segments on this engine and step until one ends or none is
        left; returns those that ended. A new `call` aborts what an earlier one left running."""
        if self.role != JUNIOR:
            raise ValueError("pump_segments runs on a Tandem junior's own engine only")
        if self._stream is None or self._stream[0] != call:
            self._end_stream()
            stream = self.backend.segment_stream(params, self.schedule, JUNIOR, stop_token_ids)
            self._stream = (call, stream, {})
        _, stream, before = self._stream
        t = time.perf_counter()
        before.update((h.key, len(h.response_ids)) for h in handoffs)
        stream.add(handoffs)
        written: list[Handoff] = []
        while len(stream) and not written:
            written = stream.step()
        self.seconds += time.perf_counter() - t
        self.tokens += sum(len(h.response_ids) - before.pop(h.key) for h in written)
        return written

    def _end_stream(self) -> None:
        if self._stream is not None:
            self._stream[1].close()
            self._stream = None

    def _cowrite(
        self, requests: Sequence[GenerationRequest], params: SamplingParams, schedule: Any
    ) -> list[GenerationResult]:
        """Co-write with the companion junior: handing each sample over the moment its segment
        ends where the engines take segments while they decode (vLLM), else in rounds."""
        common = {"decode": self._decode, "context_limit": self.backend.context_limit}
        if not hasattr(self.backend, "segment_stream"):
            senior = self._segment_writer(self.backend, params)
            junior = self._segment_writer(self.companion, params)
            return cowrite(requests, params, schedule, senior, junior, **common)
        stop = sorted(self.backend.stop_token_ids)
        stream = self.backend.segment_stream(params, schedule, SENIOR, stop)
        try:
            junior = CompanionSegments(self.companion, params, stop)
            return cowrite_continuous(requests, params, schedule, stream, junior, **common)
        finally:
            stream.close()

    def _segment_writer(self, engine: Any, params: SamplingParams) -> SegmentWriter:
        """`cowrite`'s handle on this engine's backend (the senior) or on the companion (the
        junior: a Ray actor writes while this process writes the senior's segments)."""
        stop = sorted(self.backend.stop_token_ids)

        def start(handoffs: list[Handoff]):
            if not handoffs:
                return ready([])
            if engine is self.backend:
                return ready(engine.write_segments(handoffs, params, self.schedule, SENIOR, stop))
            if isinstance(engine, ray.actor.ActorHandle):
                pending = engine.write_segments.remote(handoffs, params, stop)
                return lambda: ray.get(pending)
            return ready(engine.write_segments(handoffs, params, stop))

        return start

    def _count(self, start: float, tokens: int) -> None:
        """Book a generation call's time (less its waits for a version) and tokens."""
        waited, self._wait_counted = self._waited - self._wait_counted, self._waited
        self.seconds += time.perf_counter() - start - waited
        self.tokens += tokens
        # The step's logits and sampler buffers are free now; the engine idles while the policy
        # trains, and should not hold them meanwhile.
        release_free_heap()

    def _decode(self, ids: Sequence[int]) -> str:
        return self.backend.tokenizer.decode(ids, skip_special_tokens=True)

    def score_logprobs(
        self, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """Teacher-forced log-probs at `positions` under the engine's current weights (DRO R3)."""
        return self.backend.score_logprobs(sequences, positions)

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        self.backend.load_weights(named_tensors.items())
        release_free_heap()  # the loader's staging copies
        self.weight_version += 1
        return self.weight_version

    def stats(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "weight_version": self.weight_version,
        }

    def open_weight_group(
        self, host: str, port: int, world_size: int, rank: int, timeout_s: float
    ) -> None:
        """Join the weight group of policy rank 0 (`PolicyActor.weight_sync_address`) as
        ``rank`` (1..M); returns once every member has joined."""
        store = weight_sync.join_store(host, port, world_size, timeout_s)
        self._weight_group = weight_sync.open_group(
            rank, world_size, weight_sync.local_device(), store
        )

    def receive_weights(self, buckets: list[weight_sync.Bucket]) -> dict[str, float]:
        """Load the weights policy rank 0 broadcasts in ``buckets`` (its plan), one bucket in
        memory at a time, and bump `weight_version` as `update_weights` does.

        The names are checked against the plan before anything is received. Returns the new
        version and the seconds spent in broadcasts (transport_s) and loading (load_s).
        """
        start = time.perf_counter()
        device = weight_sync.local_device()
        with weight_sync.BucketReceiver(self._weight_group, buckets, device) as received:
            self.backend.load_weights(received, names=received.names)
        release_free_heap()  # the received buckets and the loader's staging copies
        self.weight_version += 1
        return {
            "version": self.weight_version,
            "transport_s": received.transport_s,
            "load_s": time.perf_counter() - start - received.transport_s,
        }

    def close_weight_group(self) -> None:
        self._weight_group = None

    def receive_shared_weights(
        self, buckets: list[weight_sync.Bucket], rank: Any
    ) -> dict[str, float]:
        """Load the weights that ``rank`` (the PolicyActor colocated with this engine, after its
        `start_share`) hands over bucket by bucket; returns what `receive_weights` returns."""
        start = time.perf_counter()

        def fetch(bucket: weight_sync.Bucket) -> weight_sync.SharedBuffer:
            return ray.get(rank.share_bucket.remote(bucket))

        device = weight_sync.local_device()
        with weight_sync.SharedBucketReceiver(buckets, fetch, device) as received:
            self.backend.load_weights(received, names=received.names)
        release_free_heap()  # the received buckets and the loader's staging copies
        self.weight_version += 1
        return {
            "version": self.weight_version,
            "transport_s": received.transport_s,
            "load_s": time.perf_counter() - start - received.transport_s,
        }

    def sleep(self, level: int) -> None:
        """Free the engine's device memory while its colocated rank trains (vLLM sleep mode)."""
        self.backend.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory `sleep` freed: ``tags`` "weights" before a weight load,
        "kv_cache" before generating (None: both)."""
        self.backend.wake_up(tags)
