"""Timeline model of synchronous against asynchronous rollouts: G devices split into engines and
trainers, driven by per-sample generation lengths and per-step costs.

An engine decodes all its running requests together (continuous batching): one decode step costs
`decode_step_s + running * decode_token_s` and advances every running request by one token, so
with few tokens in flight an engine's time is governed by its longest sample; admitting a request
costs `prefill_s` of engine time. A group (one prompt's samples) runs on one engine and is done
when its last sample is. The trainer trains a batch of `groups_per_step` groups in
`train_step_s + train_sample_s * samples + train_token_s * tokens`, then the weights move to the
engines in `sync_s` (trainer and engines both held).

- sync: each step the engines generate the batch, the trainers train it, then the weights sync.
- async, staleness k: engines keep admitting groups while fewer than (v + k + 1) batches were
  admitted (v: the engines' policy version, dropped groups not counted); the trainer's step t
  takes the first completed groups (in completion order) whose policy version is >= t - k and
  drops older ones. Without partial rollouts a weight update waits until the engines have
  drained their in-flight requests (admitting none meanwhile); with partial rollouts the engines
  pause between decode steps, load the weights and continue them (a group's version is its
  oldest token's). At k = 0 this is the synchronous schedule exactly.

Not modelled: a KV-cache limit on running requests, stragglers, network contention, and the
2-core case where engines and trainers share CPUs (see `validate`).

    .venv/bin/python bench/async_sim.py validate /tmp/runs/tiny-k0 /tmp/runs/tiny-k1
    .venv/bin/python bench/async_sim.py project --rollouts bench/out/agent_learning/runs/*/rollouts.jsonl
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # rlvr.run.mfu when run as a script

from harness import markdown_table, write_results  # noqa: E402

OUT = ROOT / "bench" / "out" / "async_sim"
PUBLISHED = (
    "AReaL 2.77x (arXiv 2505.24298), verl fully_async 1.72-2.67x on 32-128 GPUs, "
    "ROLL Flash 2.24x (arXiv 2510.11345); each against the same system's synchronous mode"
)


@dataclass(frozen=True)
class Costs:
    """Seconds of each unit of work (engines: per engine; trainer: the whole trainer pool)."""

    decode_step_s: float
    decode_token_s: float
    prefill_s: float
    train_token_s: float
    train_sample_s: float
    train_step_s: float
    sync_s: float

    def decode_step(self, running: int) -> float:
        """Seconds of one decode step of an engine with `running` requests."""
        return self.decode_step_s + running * self.decode_token_s

    def train(self, lengths: np.ndarray) -> float:
        """Seconds for the trainer pool to train on samples of these response lengths."""
        return (
            self.train_step_s
            + self.train_sample_s * lengths.size
            + self.train_token_s * float(lengths.sum())
        )


@dataclass(frozen=True)
class Layout:
    """How many engines share the generation, and the batch a step trains on."""

    engines: int
    groups_per_step: int
    group_size: int


class Lengths:
    """Response lengths of group j, the same for every schedule: row j of `rows` (measured
    groups in the order they were generated), or drawn in order by `draw(rng, groups)`."""

    def __init__(
        self,
        rows: np.ndarray | None = None,
        draw: Callable[[np.random.Generator, int], np.ndarray] | None = None,
        seed: int = 0,
    ):
        if (rows is None) == (draw is None):
            raise ValueError("give measured rows or a draw function, not both")
        self.rows, self.draw, self.rng = rows, draw, np.random.default_rng(seed)
        if rows is not None and (rows < 1).any():
            raise ValueError("every response length must be >= 1 token")

    def group(self, j: int) -> np.ndarray:
        """The lengths of group j's samples."""
        if self.draw is not None and (self.rows is None or j >= len(self.rows)):
            more = self.draw(self.rng, max(j + 1, 64))
            self.rows = more if self.rows is None else np.concatenate([self.rows, more])
        if j >= len(self.rows):
            raise IndexError(f"group {j}: only {len(self.rows)} measured groups")
        return self.rows[j]


@dataclass
class Timeline:
    """What a simulated run did: each step's end, and the busy seconds summed over engines and
    over the trainer up to each step's end (so any window of steps has its shares)."""

    engines: int
    step_ends: list[float] = field(default_factory=list)
    engine_busy: list[float] = field(default_factory=list)
    trainer_busy: list[float] = field(default_factory=list)
    syncs: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    dropped: int = 0

    def window(self, warmup: int) -> dict[str, float]:
        """Mean step time and busy / sync / idle shares over steps warmup .. end."""
        if not 0 <= warmup < len(self.step_ends):
            raise ValueError(f"warm-up {warmup} of {len(self.step_ends)} steps")

        def before(series: list[float]) -> float:
            return series[warmup - 1] if warmup else 0.0

        span = self.step_ends[-1] - before(self.step_ends)
        steps = len(self.step_ends) - warmup
        sync = self.syncs[-1] - before(self.syncs)
        engine = (self.engine_busy[-1] - before(self.engine_busy)) / (self.engines * span)
        trainer = (self.trainer_busy[-1] - before(self.trainer_busy)) / span
        return {
            "step_s": span / steps,
            "engine_busy": engine,
            "engine_idle": 1.0 - engine - sync / span,
            "trainer_busy": trainer,
            "trainer_idle": 1.0 - trainer - sync / span,
            "sync": sync / span,
        }

    def record(self, now: float, engine_busy: float, trainer_busy: float, sync_s: float) -> None:
        self.step_ends.append(now)
        self.engine_busy.append(engine_busy)
        self.trainer_busy.append(trainer_busy)
        self.syncs.append((self.syncs[-1] if self.syncs else 0.0) + sync_s)


def engine_seconds(groups: Sequence[np.ndarray], costs: Costs) -> float:
    """Seconds for one engine to generate `groups` admitted together: every request's prefill,
    then decode steps while requests finish, the longest last."""
    lengths = np.sort(np.concatenate(groups)) if groups else np.zeros(0)
    seconds, done = costs.prefill_s * lengths.size, 0.0
    for i, length in enumerate(lengths):
        seconds += (length - done) * costs.decode_step(lengths.size - i)
        done = length
    return float(seconds)


def simulate_sync(lengths: Lengths, layout: Layout, costs: Costs, steps: int) -> Timeline:
    """The synchronous schedule in closed form: per step, the engines' slowest batch (group j on
    engine j mod E), then training, then the weight sync."""
    timeline, now, engine_busy, trainer_busy = Timeline(layout.engines), 0.0, 0.0, 0.0
    b = layout.groups_per_step
    for t in range(steps):
        groups = [lengths.group(t * b + i) for i in range(b)]
        per_engine = [
            engine_seconds(groups[e :: layout.engines], costs) for e in range(layout.engines)
        ]
        train = costs.train(np.concatenate(groups))
        now += max(per_engine) + train + costs.sync_s
        engine_busy += sum(per_engine)
        trainer_busy += train
        timeline.staleness += [0] * b
        timeline.record(now, engine_busy, trainer_busy, costs.sync_s)
    return timeline


class Engine:
    """One engine's running requests, advanced in closed form between events: all running
    requests gain a token per decode step, so `progress` (tokens each has gained since the
    engine started) and each request's finishing progress say when the next one ends."""

    def __init__(self, costs: Costs):
        self.costs = costs
        self.clock = 0.0  # time up to which progress is integrated
        self.ready_at = 0.0  # no decoding before (prefills in progress)
        self.progress = 0.0
        self.running: list[tuple[float, int, int]] = []  # (finishing progress, seq, group)
        self.paused = False
        self.busy = 0.0
        self.stamp = 0  # events scheduled for an older stamp are stale

    def advance(self, now: float) -> float:
        """Integrate decoding up to `now` (no request may finish before it); returns the busy
        seconds added."""
        added = 0.0
        if self.running and not self.paused:
            start = max(self.clock, self.ready_at)
            if now > start:
                self.progress += (now - start) / self.costs.decode_step(len(self.running))
                added = now - start
        self.clock = max(self.clock, now)
        self.busy += added
        return added

    def admit(self, now: float, group: int, lengths: np.ndarray, seq: int) -> float:
        """Start a group's requests; returns the prefill seconds added."""
        prefill = self.costs.prefill_s * lengths.size
        self.ready_at = max(self.ready_at, now) + prefill
        for i, length in enumerate(lengths):
            heapq.heappush(self.running, (self.progress + float(length), seq + i, group))
        self.busy += prefill
        return prefill

    def finished(self) -> list[int]:
        """Pop the requests whose last token is done; returns their groups."""
        done = []
        while self.running and self.running[0][0] <= self.progress * (1 + 1e-12) + 1e-9:
            done.append(heapq.heappop(self.running)[2])
        return done

    def next_finish(self) -> float:
        """When the next running request ends (inf while paused or empty)."""
        if not self.running or self.paused:
            return math.inf
        start = max(self.clock, self.ready_at)
        left = max(self.running[0][0] - self.progress, 0.0)
        return start + left * self.costs.decode_step(len(self.running))


def simulate_async(
    lengths: Lengths,
    layout: Layout,
    costs: Costs,
    steps: int,
    max_staleness: int,
    partial: bool,
) -> Timeline:
    """The asynchronous schedule with staleness bound `max_staleness`, by discrete events
    (request ends, training ends, weight syncs end); see the module doc for its rules."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, not {max_staleness}")
    b, k = layout.groups_per_step, max_staleness
    engines = [Engine(costs) for _ in range(layout.engines)]
    timeline = Timeline(layout.engines)
    events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, engine, stamp)
    order = 0
    version = 0  # the engines' policy version = trainer steps synced
    admitted = 0  # groups admitted so far (group ids 0, 1, ...)
    group_version: dict[int, int] = {}
    group_left: dict[int, int] = {}
    group_lengths: dict[int, np.ndarray] = {}
    completed: deque[int] = deque()
    trainer = {"state": "idle", "busy": 0.0}  # idle | train | wait (for the drain) | sync
    engine_busy = 0.0

    def push(time: float, kind: str, engine: int = -1, stamp: int = 0) -> None:
        nonlocal order
        heapq.heappush(events, (time, order, kind, engine, stamp))
        order += 1

    def reschedule(e: int) -> None:
        engines[e].stamp += 1
        when = engines[e].next_finish()
        if when < math.inf:
            push(when, "finish", e, engines[e].stamp)

    def admit_more(now: float) -> None:
        nonlocal admitted, engine_busy
        if trainer["state"] in ("wait", "sync"):
            return  # draining for (or in) a weight sync
        while admitted - timeline.dropped < (version + k + 1) * b:
            e = admitted % layout.engines
            engine_busy += engines[e].advance(now)
            group_lengths[admitted] = lengths.group(admitted)
            group_version[admitted] = version
            group_left[admitted] = group_lengths[admitted].size
            engine_busy += engines[e].admit(
                now, admitted, group_lengths[admitted], admitted * 10**6
            )
            reschedule(e)
            admitted += 1

    def try_train(now: float) -> None:
        step = len(timeline.step_ends)
        if trainer["state"] != "idle" or step == steps:
            return
        fresh = [g for g in completed if group_version[g] >= step - k]
        if len(fresh) < len(completed):  # past the bound: they can only get staler
            timeline.dropped += len(completed) - len(fresh)
            completed.clear()
            completed.extend(fresh)
            admit_more(now)  # a drop frees room under the bound
        if len(completed) < b:
            return
        batch = [completed.popleft() for _ in range(b)]
        for g in batch:
            timeline.staleness.append(step - group_version[g])
        seconds = costs.train(np.concatenate([group_lengths[g] for g in batch]))
        trainer["busy"] += seconds
        trainer["state"] = "train"
        push(now + seconds, "trained")

    def start_sync(now: float) -> None:
        nonlocal engine_busy
        for e, engine in enumerate(engines):
            engine_busy += engine.advance(now)
            engine.paused = True
            reschedule(e)
        trainer["state"] = "sync"
        push(now + costs.sync_s, "synced")

    def drained() -> bool:
        return not any(engine.running for engine in engines)

    admit_more(0.0)
    while len(timeline.step_ends) < steps:
        if not events:
            raise RuntimeError("the schedule stalled (no event left): a bug in the model")
        now, _, kind, e, stamp = heapq.heappop(events)
        if kind == "finish":
            if stamp != engines[e].stamp:
                continue
            engine_busy += engines[e].advance(now)
            for g in engines[e].finished():
                group_left[g] -= 1
                if group_left[g] == 0:
                    completed.append(g)
            reschedule(e)
            if trainer["state"] == "wait" and drained():
                start_sync(now)
            admit_more(now)
            try_train(now)
        elif kind == "trained":
            if partial or drained():
                start_sync(now)
            else:
                trainer["state"] = "wait"
        elif kind == "synced":
            version += 1
            for i, engine in enumerate(engines):
                engine.clock = max(engine.clock, now)
                engine.ready_at = max(engine.ready_at, now)
                engine.paused = False
                reschedule(i)
            timeline.record(now, engine_busy, trainer["busy"], costs.sync_s)
            trainer["state"] = "idle"
            admit_more(now)
            try_train(now)
    return timeline


def simulate(
    lengths: Lengths,
    layout: Layout,
    costs: Costs,
    steps: int,
    max_staleness: int | None,
    partial: bool = False,
) -> Timeline:
    """`max_staleness` None: the synchronous schedule; else the asynchronous one."""
    if max_staleness is None:
        return simulate_sync(lengths, layout, costs, steps)
    return simulate_async(lengths, layout, costs, steps, max_staleness, partial)
