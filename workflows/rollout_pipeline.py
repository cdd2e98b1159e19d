"""Rollouts generated ahead of training under a staleness bound (`run.max_staleness: k`).

Step s trains on rollouts sampled by policy version `max(0, s - k)` (the weights after that many
updates): a fixed lag, so which weights sampled what never depends on timing, and a resumed run
samples exactly what the uninterrupted one did. One background thread collects the batches in
step order, each as soon as its version exists, up to k steps ahead of the step training; the
engines are one shared resource, held (`engines`) while a batch loads its version and collects,
and while the driver evaluates on the current weights.

How a version reaches the engines (`VersionFeed`): `SnapshotFeed` holds each version's export in
the object store until the batches that need it have loaded it, so the engines move on while the
policy trains (k >= 2 needs it); `PushFeed` pushes the current weights (any transport) once every
batch of older versions is collected, which for k = 1 overlaps one step's generation with the
next step's update and nothing more. A committed step's checkpoint holds the finished batches of
the versions before its own; the first batch of its own version is collected again on resume.

Partial rollouts (`run.partial_rollout_tokens: L`, snapshots only): step s's trajectories sample
their first L model tokens with version max(0, s - k) and the rest with max(0, s - k + 1), the
engines loading the newer version between decode steps once every trajectory of the batch has
paused at its boundary (`rlvr.generation.segments`); they fetch it from a `VersionBoard` the
pipeline posts every snapshot to. A batch's second version is at most the checkpoint's own, so a
committed checkpoint still holds every batch begun with an older version, finished.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import ray

from actors.versions import BOARD_THREADS, VersionBoard
from rlvr.generation.base import SamplingParams
from rlvr.methods.base import Collected, Method, StepServices
from rlvr.tasks.base import Problem
from workflows.workers import ActorFailure, Worker

PIPELINE_FILE = "pipeline.pkl"


class PipelineClosed(RuntimeError):
    """The pipeline closed while a batch waited for its version (the run is stopping)."""


def sampling_version(step: int, max_staleness: int) -> int:
    """The policy version that samples step `step`'s rollouts under the fixed lag (with partial
    rollouts, their oldest tokens)."""
    return max(0, step - max_staleness)


def partial_versions(step: int, max_staleness: int) -> tuple[int, int]:
    """The versions of step `step`'s partial rollouts: their first tokens', then the rest's."""
    first = sampling_version(step, max_staleness)
    return first, sampling_version(step + 1, max_staleness)


@dataclass
class Batch:
    """Step `step`'s rollouts: `n` per prompt id, sampled by policy `version`; the seconds of
    their phases, the wall-clock span of their collection, and the result (a future until it is
    collected)."""

    step: int
    version: int
    n: dict[str, int]
    times: dict[str, float] = field(default_factory=dict)
    span: tuple[float, float] = (0.0, 0.0)
    collected: Collected | None = None
    future: Future | None = None

    def finish(self, training_step: int) -> None:
        """Wait for the collection and keep its result; re-raises its error, an actor's naming
        `training_step` (the step the driver is at) too when the batch was sampled ahead."""
        if self.future is not None:
            try:
                collected = self.future.result()
            except ActorFailure as err:
                if self.step == training_step:
                    raise
                raise failed_ahead(err, self.step, training_step) from err
            self.collected, self.future = collected, None

    @property
    def done(self) -> bool:
        return self.future is None or self.future.done()


def failed_ahead(err: ActorFailure, batch_step: int, training_step: int) -> ActorFailure:
    """`err` of step `batch_step`'s collection, surfacing during step `training_step`: the same
    failure (`lost` kept, so a lost engine is still recovered), its message naming both steps."""
    return ActorFailure(
        f"{err} (step {batch_step}'s rollouts, sampled ahead during training step {training_step})",
        lost=err.lost,
    )


class VersionFeed(Protocol):
    """How policy versions reach the engines."""

    def start(self, version: int, step: int | None) -> None:
        """The engines already hold `version` (their first weights, or a resumed checkpoint's)."""
        ...

    def publish(self, version: int, step: int | None) -> None:
        """The policy now holds `version` (driver thread, after an update)."""
        ...

    def wait_for(self, version: int, closed: threading.Event) -> None:
        """Block until `version` can be loaded (pipeline thread, engines not held)."""
        ...

    def load(self, version: int, step: int | None) -> None:
        """Make the engines hold `version` (engines held)."""
        ...

    def release_before(self, version: int) -> None:
        """No batch will load a version below `version` again."""
        ...


class _Versions:
    """The newest published version, which threads wait on."""

    def __init__(self) -> None:
        self.published = -1
        self.changed = threading.Condition()

    def set(self, version: int) -> None:
        with self.changed:
            self.published = version
            self.changed.notify_all()

    def wait_for(self, version: int, closed: threading.Event) -> None:
        with self.changed:
            while self.published < version:
                if closed.is_set():
                    raise PipelineClosed(f"closed while waiting for policy version {version}")
                self.changed.wait(timeout=0.5)


class SnapshotFeed:
    """Each published version is exported into the object store (`ObjectStoreSync.export`) and
    held until a later batch's version replaces it on the engines."""

    def __init__(self, sync: Any, board: Any = None) -> None:
        """`board`: a `VersionBoard` (a Worker over it) every snapshot is posted to as well, for
        engines that load a version in the middle of a batch (partial rollouts)."""
        self.sync = sync
        self.board = board
        self.versions = _Versions()
        # the driver publishes while the pipeline thread loads and releases: every access to
        # `snapshots` holds `_lock` (`loaded` changes only with the pipeline's engines held)
        self._lock = threading.Lock()
        self.snapshots: dict[int, Any] = {}
        self.loaded: int | None = None

    def start(self, version: int, step: int | None) -> None:
        self.loaded = version
        self.publish(version, step)

    def publish(self, version: int, step: int | None) -> None:
        snapshot = self.sync.export(step)
        with self._lock:
            self.snapshots[version] = snapshot
        if self.board is not None:
            self.board.run("post", version, [snapshot], step=step)
        self.versions.set(version)

    def wait_for(self, version: int, closed: threading.Event) -> None:
        self.versions.wait_for(version, closed)

    def load(self, version: int, step: int | None) -> None:
        if self.loaded != version:
            with self._lock:
                snapshot = self.snapshots[version]
            self.sync.load(snapshot, step)
            self.loaded = version

    def release_before(self, version: int) -> None:
        with self._lock:
            for old in [v for v in self.snapshots if v < version]:
                del self.snapshots[old]
        if self.board is not None:
            self.board.run("release_before", version)


class PushFeed:
    """The current weights are pushed (`push`: the run's weight sync) once every batch sampled
    by an older version is collected (`collected_before`), while the engines are idle."""

    def __init__(
        self,
        push: Callable[[int | None], None],
        collected_before: Callable[[int], Any],
        engines: threading.RLock,
    ) -> None:
        self.push = push
        self.collected_before = collected_before
        self.engines = engines
        self.versions = _Versions()
        self.loaded: int | None = None

    def start(self, version: int, step: int | None) -> None:
        self.loaded = version
        self.versions.set(version)

    def publish(self, version: int, step: int | None) -> None:
        self.collected_before(version)
        with self.engines:
            self.push(step)
        self.loaded = version
        self.versions.set(version)

    def wait_for(self, version: int, closed: threading.Event) -> None:
        self.versions.wait_for(version, closed)

    def load(self, version: int, step: int | None) -> None:
        if self.loaded != version:
            raise RuntimeError(f"the engines hold policy version {self.loaded}, not {version}")

    def release_before(self, version: int) -> None:
        pass  # nothing held


class RolloutPipeline:
    """Collects steps' rollouts in one background thread, each on its fixed-lag version."""

    def __init__(
        self,
        method: Method,
        services: StepServices,
        max_staleness: int,
        steps: int,
        batch_of: Callable[[int], tuple[list[Problem], SamplingParams, int]],
        partial_tokens: int = 0,
    ) -> None:
        """`batch_of(step)` gives the step's problems, sampling params and group size;
        `partial_tokens` > 0: partial rollouts switching version after that many tokens."""
        self.method, self.services = method, services
        self.k, self.steps, self.batch_of = max_staleness, steps, batch_of
        self.partial_tokens = partial_tokens
        self.board: Worker | None = None
        self.feed: VersionFeed | None = None
        self.batches: dict[int, Batch] = {}
        self.submitted_through = -1
        self.engines = threading.RLock()
        self.busy: list[tuple[float, float]] = []
        self._busy_lock = threading.Lock()
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-pipeline")

    def start(self, sync: Any, push: Callable[[int | None], None], version: int) -> None:
        """Begin with the engines holding policy `version` (their first weights, or a resumed
        checkpoint's): versions reach them as snapshots when `sync` (the run's weight sync) can
        export one, else by `push`."""
        if hasattr(sync, "export"):
            if self.partial_tokens:
                self.board = start_board(sync.generator)
            self.feed = SnapshotFeed(sync, self.board)
        elif self.partial_tokens:
            raise ValueError(
                "partial rollouts load versions from snapshots: the weight sync must be the "
                "object store's"
            )
        else:
            self.feed = PushFeed(push, self.collected_before, self.engines)
        self.feed.start(version, None)

    def fill(self, step: int) -> None:
        """Submit every batch through step + k (the run's last step at most) not yet submitted."""
        for s in range(self.submitted_through + 1, min(step + self.k, self.steps - 1) + 1):
            problems, params, group_size = self.batch_of(s)
            batch = Batch(s, sampling_version(s, self.k), {p.id: group_size for p in problems})
            plan = {"step": s, "n": batch.n}
            batch.future = self._pool.submit(self._collect, batch, problems, plan, params)
            self.batches[s] = batch
            self.submitted_through = s

    def _collect(
        self, batch: Batch, problems: list[Problem], plan: dict, params: SamplingParams
    ) -> Collected:
        assert self.feed is not None
        self.feed.wait_for(batch.version, self._closed)
        with self.engines:
            t0 = time.perf_counter()
            self.feed.load(batch.version, batch.step)
            self.feed.release_before(batch.version)
            if self.partial_tokens:
                got = self._collect_partial(batch, problems, plan, params)
            else:
                got = self.method.collect(
                    self.services, problems, plan, params, batch.step, batch.times
                )
            batch.span = (t0, time.perf_counter())
        with self._busy_lock:
            self.busy.append(batch.span)
        return got

    def _collect_partial(
        self, batch: Batch, problems: list[Problem], plan: dict, params: SamplingParams
    ) -> Collected:
        """Collect with the engines in partial-rollout mode; they end holding the batch's second
        version, which the next batch starts from."""
        assert isinstance(self.feed, SnapshotFeed) and self.board is not None
        versions = partial_versions(batch.step, self.k)
        pool = self.feed.sync.generator
        pool.run("begin_partial", self.partial_tokens, versions, self.board.target)
        try:
            return self.method.collect(
                self.services, problems, plan, params, batch.step, batch.times
            )
        finally:
            # part of the batch's time_generate, spent waiting for the newer version
            batch.times["time_wait_version"] = pool.run("end_partial", step=batch.step)
            self.feed.loaded = versions[1]

    def ready(self) -> int:
        """Batches collected and not yet taken."""
        return sum(1 for b in self.batches.values() if b.done)

    def take(self, step: int, plan_n: dict[str, int]) -> Batch:
        """Step `step`'s batch, waiting for its collection."""
        batch = self.batches.pop(step)
        batch.finish(step)
        if batch.n != plan_n:
            raise RuntimeError(
                f"step {step}: the controller planned {plan_n} rollouts but {batch.n} were "
                "collected ahead"
            )
        return batch

    def collected_before(self, version: int) -> list[int]:
        """Wait until every submitted batch sampled by a version below `version` is collected;
        returns their steps. The policy holds `version`: training is at step `version - 1`
        (its push, its checkpoint)."""
        steps = [s for s in sorted(self.batches) if self.batches[s].version < version]
        for s in steps:
            self.batches[s].finish(training_step=version - 1)
        return steps

    def publish(self, version: int, step: int | None) -> None:
        """The policy now holds `version` (after step `version - 1`'s update)."""
        assert self.feed is not None
        self.feed.publish(version, step)

    @contextmanager
    def engines_at(self, version: int, step: int | None) -> Iterator[None]:
        """Hold the engines with policy `version` loaded (the driver's evaluation)."""
        assert self.feed is not None
        with self.engines:
            self.feed.load(version, step)
            yield

    def engines_busy_share(self, start: float, end: float) -> float:
        """Share of [start, end] the pipeline spent loading versions and collecting."""
        with self._busy_lock:
            busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.busy)
            self.busy = [(a, b) for a, b in self.busy if b > start]
        return busy / max(end - start, 1e-9)

    def save(self, directory: Path, version: int) -> None:
        """Write the batches sampled by versions before `version` (the checkpoint's own), once
        collected, into a checkpoint being committed."""
        kept = self.collected_before(version)
        if kept:
            saved = {s: self.batches[s] for s in kept}
            (directory / PIPELINE_FILE).write_bytes(pickle.dumps(saved))

    def load(self, directory: Path, last_step: int) -> None:
        """Take back the batches a committed checkpoint of `last_step` holds; the next ones are
        collected from its weights."""
        path = directory / PIPELINE_FILE
        self.batches = pickle.loads(path.read_bytes()) if path.is_file() else {}
        self.submitted_through = max(self.batches, default=last_step)

    def close(self) -> None:
        self._closed.set()
        if self.board is not None:
            self.board.run("close")  # engines waiting for a version give up
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.board is not None and self.board.is_actor:
            ray.kill(self.board.target, no_restart=True)


def start_board(pool: Any) -> Worker:
    """A `VersionBoard` the engines of `pool` can reach: an actor beside actor engines (threaded,
    each waiting engine holds a thread), else a plain object."""
    if any(w.is_actor for w in pool.workers):
        actor = ray.remote(VersionBoard).options(num_cpus=0, max_concurrency=BOARD_THREADS)
        return Worker(actor.remote(), "VersionBoard")
    return Worker(VersionBoard(), "VersionBoard")
