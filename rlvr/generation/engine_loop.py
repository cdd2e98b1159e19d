"""The engine loop: trajectories advanced turn by turn over an engine that samples requests.

`iter_trajectories` runs `trajectories.Trajectory` objects on a `TurnEngine`: every trajectory's
turn 0 is submitted at once; when a turn ends, its trajectory's callback runs on a small thread
pool and, as soon as it answers, the next turn is submitted while the engine keeps sampling the
others (vLLM: continuous batching, `VLLMBackend`); an engine with `rounds` (the transformers
backend) samples its submitted turns together and waits for every pending callback before the
next round, so its batches do not depend on how fast callbacks answer. Trajectories are yielded
as they end, so a caller may take finished ones (completed groups) before the slowest is done.

Single-turn sampling is the same loop (`sample_trajectories` / `grouped_samples`): sample j of a
request is a trajectory without a callback seeded `sample_seed(request, params, j)`. With
`Segments` (partial rollouts, `rlvr.generation.segments`) every trajectory pauses after its first
model tokens until the loop has moved the engine to a newer policy version, then continues.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any, Protocol

from rlvr.algorithms.tandem import WordSwitchSchedule
from rlvr.generation.base import (
    GenerationRequest,
    GenerationResult,
    Sample,
    SamplingParams,
    StopRule,
    StopRuleFactory,
    sample_seed,
)
from rlvr.generation.segments import Segments, continued, segment_seed, stamped
from rlvr.generation.stop_rules import StopRuleTracker
from rlvr.generation.tandem_support import AuthorTracker, tandem_seed
from rlvr.generation.trajectories import (
    Continue,
    Finish,
    Trajectory,
    TrajectoryLimits,
    TrajectoryResult,
    TrajectoryStatus,
    Turn,
    reply_error,
    turn_seed,
)

CALLBACK_THREADS = 16
"""Turn callbacks running at once; they mostly wait (on a tool's or environment's process)."""


@dataclass
class TurnRequest:
    """One turn for a `TurnEngine` to sample (n = 1)."""

    prompt_ids: list[int]
    seed: int | None
    max_tokens: int
    stop_rule: StopRule | None = None


@dataclass
class FinishedTurn:
    """A sampled turn, under the key it was submitted with."""

    key: int
    sample: Sample
    cached_tokens: int = 0


class TurnEngine(Protocol):
    """What the loop needs of an engine: turns in, finished turns out."""

    context_limit: int
    """Prompt + response tokens one request may hold."""
    vocab_size: int
    """Token ids are 0..vocab_size - 1."""
    rounds: bool
    """True: sample the submitted turns together, and only once no callback is pending."""

    def submit(self, key: int, request: TurnRequest) -> None: ...

    def poll(self) -> list[FinishedTurn]:
        """Advance (one engine step, or a whole round) and return the turns that finished."""
        ...

    def in_flight(self) -> int:
        """Turns submitted and not yet returned by `poll`."""
        ...

    def abort(self) -> None:
        """Drop every turn in flight (the loop ended early: an error, or its consumer left)."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """A sample's text (`Sample.text`) from its token ids."""
        ...


@dataclass
class TurnHooks:
    """What an engine consults while it samples one turn: the turn's stop-rule tracker and, in a
    Tandem rollout, its author state (`seed` is then the tandem seed, drawn when unseeded)."""

    seed: int | None
    tracker: StopRuleTracker | None = None
    author: AuthorTracker | None = None

    @classmethod
    def make(
        cls,
        request: TurnRequest,
        eos_token_id: int,
        params: SamplingParams,
        schedule: WordSwitchSchedule | None,
    ) -> TurnHooks:
        hooks = cls(request.seed)
        if request.stop_rule is not None:
            hooks.tracker = StopRuleTracker(request.stop_rule, eos_token_id)
        if schedule is not None:
            hooks.seed = tandem_seed(request.seed)
            hooks.author = AuthorTracker(schedule, hooks.seed, params.temperature, params.top_p)
        return hooks

    def finish(self, token_ids: list[int]) -> tuple[dict[str, Any], list[int] | None]:
        """The sample's flags (the stop rule's, Tandem's counters) and authorship."""
        flags = self.tracker.flags(len(token_ids)) if self.tracker is not None else {}
        if self.author is None:
            return flags, None
        authorship = self.author.finish(token_ids)
        flags.update(self.author.flags())
        return flags, authorship


def check_tandem(schedule: WordSwitchSchedule | None, has_junior: bool, stop_rules: bool) -> None:
    """Refuse a Tandem rollout on an engine without a junior, or combined with stop rules."""
    if schedule is None:
        return
    if not has_junior:
        raise ValueError("tandem generation needs a junior: start the backend with junior_path")
    if stop_rules:
        raise ValueError("stop rules and tandem generation cannot be combined")


def iter_trajectories(
    engine: TurnEngine,
    trajectories: Sequence[Trajectory],
    params: SamplingParams,
    limits: TrajectoryLimits | None = None,
    callback_threads: int = CALLBACK_THREADS,
    segments: Segments | None = None,
) -> Iterator[tuple[int, TrajectoryResult]]:
    """(index, result) of each trajectory as it ends; see the module and `trajectories` docs.

    A first prompt that is empty, holds ids outside the vocabulary or leaves no room in the
    context raises ValueError before anything is sampled, as do `segments` combined with stop
    rules or stop strings. Leaving the iterator early aborts what is still in flight.
    """
    loop = _Loop(engine, trajectories, params, limits or TrajectoryLimits(), callback_threads)
    return loop.run(segments)


def run_trajectories(
    engine: TurnEngine,
    trajectories: Sequence[Trajectory],
    params: SamplingParams,
    limits: TrajectoryLimits | None = None,
    callback_threads: int = CALLBACK_THREADS,
    segments: Segments | None = None,
) -> list[TrajectoryResult]:
    """Every trajectory's result, in the order given."""
    return ordered(
        iter_trajectories(engine, trajectories, params, limits, callback_threads, segments),
        len(trajectories),
    )


def ordered(ended: Iterable[tuple[int, TrajectoryResult]], count: int) -> list[TrajectoryResult]:
    """The results `iter_trajectories` yields for `count` trajectories, in their order."""
    results: list[TrajectoryResult | None] = [None] * count
    for index, result in ended:
        results[index] = result
    return results  # type: ignore[return-value]


def sample_trajectories(
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    stop_rule_factory: StopRuleFactory | None = None,
) -> list[Trajectory]:
    """One single-turn trajectory per sample, request by request: sample j of request i seeded
    `sample_seed(request, params, j)` with the stop rule `stop_rule_factory(i, j)`."""
    out = []
    for i, request in enumerate(requests):
        if request.n < 0:
            raise ValueError(f"request {request.request_id!r}: n must be >= 0, got {request.n}")
        for j in range(request.n):
            rule = None
            if stop_rule_factory is not None:
                rule = functools.partial(_fixed_rule, stop_rule_factory, i, j)
            out.append(
                Trajectory(
                    list(request.prompt_ids),
                    seed=sample_seed(request, params, j),
                    stop_rule=rule,
                    trajectory_id=request.request_id,
                )
            )
    return out


def _fixed_rule(factory: StopRuleFactory, i: int, j: int, turn: int) -> StopRule:
    return factory(i, j)


def grouped_samples(
    requests: Sequence[GenerationRequest], results: Sequence[TrajectoryResult]
) -> list[GenerationResult]:
    """The results of `sample_trajectories(requests, ...)` as one `GenerationResult` per request."""
    flat = iter(results)
    return [
        GenerationResult(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            samples=[next(flat).turns[0].sample for _ in range(request.n)],
        )
        for request in requests
    ]


@dataclass
class _InFlight:
    """A turn in the engine: its prompt and seed, the tokens it sampled before a pause (`head`),
    and whether its request stops at the segment boundary rather than at the turn's own limit."""

    prompt_ids: list[int]
    seed: int | None
    head: Sample | None = None
    cached_tokens: int = 0
    at_boundary: bool = False


class _Loop:
    """One `iter_trajectories` call: the trajectories' state between the engine and callbacks."""

    def __init__(
        self,
        engine: TurnEngine,
        trajectories: Sequence[Trajectory],
        params: SamplingParams,
        limits: TrajectoryLimits,
        callback_threads: int,
    ) -> None:
        self.engine = engine
        self.trajectories = trajectories
        self.params = params
        self.limits = limits
        self.callback_threads = callback_threads
        self.context = engine.context_limit
        if limits.max_context is not None:
            self.context = min(self.context, limits.max_context)
        self.results = [TrajectoryResult(t.trajectory_id) for t in trajectories]
        self.sampling: dict[int, _InFlight] = {}
        """Trajectories with a turn in the engine."""
        self.segments: Segments | None = None
        self.segment = 0
        self.paused: dict[int, _InFlight] = {}
        """Trajectories waiting at the segment boundary for the engine's next version."""
        self.waiting: dict[int, float] = {}
        """Trajectories whose callback runs: the monotonic time it must answer by."""
        self.replies: SimpleQueue[tuple[int, Future]] = SimpleQueue()
        self.ended: deque[int] = deque()
        self.executor: ThreadPoolExecutor | None = None

    def run(self, segments: Segments | None) -> Iterator[tuple[int, TrajectoryResult]]:
        for trajectory in self.trajectories:
            self._check_first_prompt(trajectory)
        if segments is not None:
            if self.params.stop or any(t.stop_rule for t in self.trajectories):
                raise ValueError(
                    "partial rollouts (segments) cannot continue stop rules or strings"
                )
            segments.hold(segments.version(0))
        self.segments = segments
        try:
            for index, trajectory in enumerate(self.trajectories):
                self._submit(index, list(trajectory.prompt_ids))
            while self.engine.in_flight() or self.waiting or self.paused:
                self._take_replies(block=False)
                if self.engine.in_flight() and not (self.engine.rounds and self.waiting):
                    for finished in self.engine.poll():
                        self._turn_ended(finished)
                elif self.waiting:
                    self._take_replies(block=True)
                elif self.paused:
                    self._next_segment()
                self._expire()
                while self.ended:
                    index = self.ended.popleft()
                    yield index, self.results[index]
        finally:
            self.engine.abort()
            if self.executor is not None:
                self.executor.shutdown(wait=False, cancel_futures=True)

    def _check_first_prompt(self, trajectory: Trajectory) -> None:
        ids, name = trajectory.prompt_ids, trajectory.trajectory_id
        if not ids:
            raise ValueError(f"trajectory {name!r}: the prompt is empty")
        if len(ids) >= self.context:
            raise ValueError(
                f"trajectory {name!r}: a prompt of {len(ids)} tokens leaves no room in a "
                f"context of {self.context}"
            )
        vocab = self.engine.vocab_size
        if any(isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"trajectory {name!r}: prompt ids outside [0, {vocab})")

    def _submit(self, index: int, prompt_ids: list[int], paused: _InFlight | None = None) -> None:
        """Submit the trajectory's next turn, or continue its `paused` one."""
        trajectory, result = self.trajectories[index], self.results[index]
        turn = len(result.turns)
        state = paused or _InFlight(prompt_ids, turn_seed(trajectory.seed, turn))
        head = [] if state.head is None else state.head.token_ids
        max_tokens = min(self.params.max_tokens - len(head), self.context - len(prompt_ids + head))
        used = result.model_tokens + len(head)
        if self.limits.max_tokens is not None:
            max_tokens = min(max_tokens, self.limits.max_tokens - used)
        state.at_boundary = False
        if self.segments is not None and self.segment == 0:
            room = self.segments.tokens - used
            if room <= 0:
                self.paused[index] = state
                return
            state.at_boundary = room < max_tokens
            max_tokens = min(max_tokens, room)
        rule = trajectory.stop_rule(turn) if trajectory.stop_rule is not None else None
        seed = segment_seed(state.seed, self.segment) if head else state.seed
        self.sampling[index] = state
        self.engine.submit(index, TurnRequest(prompt_ids + head, seed, max_tokens, rule))

    def _next_segment(self) -> None:
        """Every trajectory left waits at the boundary: the engine moves to the next version and
        the paused turns continue (in trajectory order)."""
        assert self.segments is not None
        self.segment += 1
        self.segments.hold(self.segments.version(self.segment))
        paused, self.paused = self.paused, {}
        for index in sorted(paused):
            self._submit(index, paused[index].prompt_ids, paused[index])

    def _turn_ended(self, finished: FinishedTurn) -> None:
        index = finished.key
        state = self.sampling.pop(index)
        sample = finished.sample
        if self.segments is not None:
            sample = stamped(sample, self.segments.version(self.segment))
            if state.head is not None:
                sample = continued(state.head, sample, self.engine.decode)
        state.cached_tokens += finished.cached_tokens
        if state.at_boundary and finished.sample.finish_reason == "length":
            state.head = sample
            self.paused[index] = state
            return
        result = self.results[index]
        result.turns.append(
            Turn(state.prompt_ids, state.seed, sample, cached_tokens=state.cached_tokens)
        )
        callback = self.trajectories[index].next_turn
        if callback is None:
            self._end(index, "done")
            return
        if self.executor is None:
            self.executor = ThreadPoolExecutor(self.callback_threads, "turn-callback")
        timeout = self.limits.callback_timeout_s
        self.waiting[index] = float("inf") if timeout is None else time.monotonic() + timeout
        future = self.executor.submit(callback, result)
        future.add_done_callback(functools.partial(self._answered, index))

    def _answered(self, index: int, future: Future) -> None:
        """Runs in the callback's thread (or this one, if it already finished): hand over."""
        self.replies.put((index, future))

    def _take_replies(self, block: bool) -> None:
        """Handle the callbacks that answered; with `block`, wait for one first (at most until
        the earliest deadline)."""
        if block:
            wait = min(self.waiting.values()) - time.monotonic()
            try:
                self._reply(
                    *self.replies.get(timeout=None if wait == float("inf") else max(wait, 0))
                )
            except Empty:
                return
        while True:
            try:
                self._reply(*self.replies.get_nowait())
            except Empty:
                return

    def _reply(self, index: int, future: Future) -> None:
        if self.waiting.pop(index, None) is None:
            return  # it answered after its deadline: the trajectory has ended
        try:
            reply = future.result()
        except Exception as err:  # the callback's own failure ends its trajectory only
            self._end(index, "callback_error", f"the callback raised {type(err).__name__}: {err}")
            return
        error = reply_error(reply, self.engine.vocab_size)
        if error:
            self._end(index, "callback_error", error)
            return
        result = self.results[index]
        turn = result.turns[-1]
        turn.info = dict(reply.info)
        if isinstance(reply, Finish):
            self._end(index, "done")
            return
        assert isinstance(reply, Continue)
        observation = [int(t) for t in reply.observation_ids]
        prompt_ids = turn.prompt_ids + turn.sample.token_ids + observation
        limits = self.limits
        if limits.max_turns is not None and len(result.turns) >= limits.max_turns:
            self._end(index, "max_turns")
        elif limits.max_tokens is not None and result.model_tokens >= limits.max_tokens:
            self._end(index, "token_budget")
        elif len(prompt_ids) >= self.context:
            self._end(index, "context_length")
        else:
            turn.observation_ids = observation
            self._submit(index, prompt_ids)

    def _expire(self) -> None:
        now = time.monotonic()
        for index, deadline in list(self.waiting.items()):
            if now >= deadline:
                del self.waiting[index]
                self._end(
                    index,
                    "callback_timeout",
                    f"the callback did not answer within {self.limits.callback_timeout_s} s",
                )

    def _end(self, index: int, status: TrajectoryStatus, error: str = "") -> None:
        result = self.results[index]
        result.status, result.error = status, error
        self.ended.append(index)
