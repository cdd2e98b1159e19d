"""How the policy's new weights reach every generation engine after a step (`sync.transport`).

`ObjectStoreSync`: policy rank 0 exports the merged weights once, Ray's object store holds that
one copy and every engine loads it; a full host copy of the model per sync, which the store's
shared memory keeps resident (what "auto" picks for in-process workers only). `CollectiveSync`: a process group of policy rank 0 and the engines
(`rlvr.training.weight_sync`), opened once; every push streams the weights in buckets of
`sync.bucket_mb`, in the engines' dtype, so no process holds more than a bucket beyond its model.
`ColocatedSync` (`resources.colocate`): each policy rank hands the engine beside it the same
buckets on their shared device (CUDA IPC on a GPU).

All drive ``policy.workers`` (policy ranks, rank 0 first: a PolicyGroup's) and
``generator.workers`` (engines, engine 0 first: a GeneratorPool's), and after a push set
``generator.weight_version``, which the pool sends with every generate.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any, Protocol

import ray
import torch

from rlvr.config import Config
from rlvr.training.weight_sync import DEFAULT_TIMEOUT_S, plan_buckets
from workflows.workers import ActorFailure, Worker

FAILURE_GRACE_S = 10.0
"""After one member of a sync fails, how long the others get to finish before the sync raises
(a broadcast whose peer died may otherwise only fail at the group's timeout)."""


class WeightSync(Protocol):
    transport: str
    """The `sync.transport` it implements."""

    def push(self, step: int | None = None) -> int:
        """Load the policy's current weights into every engine; returns their new weight version."""
        ...

    def close(self) -> None: ...


class ObjectStoreSync:
    """Rank 0's export (every rank joins its ZeRO-3 gathers) goes to every engine by reference:
    the object store holds it once and the driver never fetches it."""

    transport = "object_store"

    def __init__(self, policy: Any, generator: Any) -> None:
        self.policy = policy
        self.generator = generator

    def push(self, step: int | None = None) -> int:
        return self.load(self.export(step), step)

    def export(self, step: int | None = None) -> Any:
        """Rank 0's export of the policy's current weights, held by the object store (the
        driver never fetches it): a snapshot engines may load later (`run.max_staleness`)."""
        ranks = _labelled(self.policy.workers)
        exports = [worker.call("export_weights") for _, worker in ranks]
        # Rank 0's export is not resolved here (that would copy it into the driver): its failure
        # reaches every engine's load, which reports it.
        _resolve([(*ranks[i], exports[i]) for i in range(1, len(ranks))], step)
        return exports[0]

    def load(self, snapshot: Any, step: int | None = None) -> int:
        """Every engine loads an `export`; returns their new weight version."""
        engines = _labelled(self.generator.workers)
        loads = [worker.call("update_weights", snapshot) for _, worker in engines]
        calls = [(*engine, load) for engine, load in zip(engines, loads, strict=True)]
        return _adopt_version(self.generator, _resolve(calls, step))

    def close(self) -> None:
        """Nothing to release: each push is self-contained."""


class CollectiveSync:
    """A weight group of policy rank 0 (rank 0) and the engines (ranks 1..M), opened here once.

    Every push: all policy ranks call `broadcast_weights` (rank 0 sends) while every engine calls
    `receive_weights`, concurrently, over one bucket plan made here from rank 0's manifest. A
    failed push names every member that failed and leaves the group unusable: later pushes raise.
    """

    transport = "collective"

    def __init__(
        self,
        policy: Any,
        generator: Any,
        dtype: torch.dtype,
        bucket_bytes: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        workers = [*policy.workers, *generator.workers]
        if not all(worker.is_actor for worker in workers):
            raise ValueError(
                "a collective weight sync needs the policy and engines as Ray actors "
                "(in-process workers share one process)"
            )
        self.policy = policy
        self.generator = generator
        self.failed: str | None = None
        root_label, root = _labelled(policy.workers)[0]
        engines = _labelled(generator.workers)
        world_size = 1 + len(engines)
        host, port = root.run("weight_sync_address", world_size, timeout_s)
        calls = [(root_label, root, root.call("open_weight_group", world_size))]
        for rank, (label, worker) in enumerate(engines, start=1):
            future = worker.call("open_weight_group", host, port, world_size, rank, timeout_s)
            calls.append((label, worker, future))
        _resolve(calls, step=None)
        manifest = root.run("weight_manifest")
        self.buckets = plan_buckets(manifest, dtype, bucket_bytes)

    def push(self, step: int | None = None) -> int:
        if self.failed is not None:
            raise RuntimeError(f"the weight group broke in an earlier push ({self.failed})")
        ranks = _labelled(self.policy.workers)
        engines = _labelled(self.generator.workers)
        calls = [(*rank, rank[1].call("broadcast_weights", self.buckets)) for rank in ranks]
        calls += [(*engine, engine[1].call("receive_weights", self.buckets)) for engine in engines]
        try:
            results = _resolve(calls, step)
        except ActorFailure as err:
            self.failed = str(err)
            raise
        return _adopt_version(self.generator, [r["version"] for r in results[len(ranks) :]])

    def close(self) -> None:
        """Drop the group in policy rank 0 and every engine; members already gone are skipped."""
        members = [self.policy.workers[0], *self.generator.workers]
        futures = [worker.call("close_weight_group") for worker in members]
        for worker, future in zip(members, futures, strict=True):
            with contextlib.suppress(ActorFailure):
                worker.get(future)


class ColocatedSync:
    """Policy rank i hands engine i (placed in its bundle: `resources.colocate`) the merged
    weights bucket by bucket, all pairs at once: CUDA IPC on a shared GPU, the node's shared
    memory on CPU (`rlvr.training.weight_sync.SharedBucketReceiver`).

    Every rank exports (under ZeRO-3 all join each gather anyway), so no weight crosses between
    nodes or devices, and each engine pulls the next bucket from its rank when its loader asks.
    """

    transport = "colocated"

    def __init__(self, policy: Any, generator: Any, dtype: torch.dtype, bucket_bytes: int) -> None:
        ranks, engines = policy.workers, generator.workers
        if len(ranks) != len(engines) or not all(w.is_actor for w in [*ranks, *engines]):
            raise ValueError(
                "a colocated weight sync pairs each policy rank with one engine, all Ray actors "
                f"(got {len(ranks)} ranks and {len(engines)} engines)"
            )
        self.policy = policy
        self.generator = generator
        manifest = ranks[0].run("weight_manifest")
        self.buckets = plan_buckets(manifest, dtype, bucket_bytes)

    def push(self, step: int | None = None) -> int:
        ranks = _labelled(self.policy.workers)
        engines = _labelled(self.generator.workers)
        _resolve([(*rank, rank[1].call("start_share")) for rank in ranks], step)
        calls = [
            (*engine, engine[1].call("receive_shared_weights", self.buckets, rank[1].target))
            for rank, engine in zip(ranks, engines, strict=True)
        ]
        results = _resolve(calls, step)
        _resolve([(*rank, rank[1].call("end_share")) for rank in ranks], step)
        return _adopt_version(self.generator, [r["version"] for r in results])

    def close(self) -> None:
        """Nothing to release: each push opens and closes its streams."""


def make_weight_sync(cfg: Config, policy: Any, generator: Any) -> WeightSync:
    """The sync `cfg.sync.transport` names; "auto" is the colocated hand-over when ranks and
    engines are colocated, the object store for in-process workers and the collective broadcast
    otherwise, one CPU engine included (with `run.max_staleness` >= 2 or partial rollouts, the
    object store, whose exports the engines load as snapshots): a push through the object store leaves a model-sized
    copy of shared memory resident (the store keeps the pages it once used) and, on CPU, is also
    the slower of the two (bench/out/weight_sync/cpu.md)."""
    transport = cfg.sync.transport
    actors = all(w.is_actor for w in [*policy.workers, *generator.workers])
    if transport == "auto":
        transport = "collective" if actors else "object_store"
        if actors and cfg.resources.colocate:
            transport = "colocated"
        if cfg.run.max_staleness >= 2 or cfg.run.partial_rollout_tokens:
            transport = "object_store"  # engines load held snapshots of older versions
    if transport == "object_store":
        return ObjectStoreSync(policy, generator)
    bucket_bytes = int(cfg.sync.bucket_mb * 2**20)
    dtype = getattr(torch, cfg.engine_dtype)
    if transport == "colocated":
        return ColocatedSync(policy, generator, dtype, bucket_bytes)
    return CollectiveSync(policy, generator, dtype, bucket_bytes)


def _labelled(workers: Sequence[Worker]) -> list[tuple[str, Worker]]:
    """Each worker with a name that tells it apart (policy ranks share theirs: "PolicyActor 1")."""
    names = [w.name for w in workers]
    if len(set(names)) == len(names):
        return list(zip(names, workers, strict=True))
    return [(f"{w.name} {i}", w) for i, w in enumerate(workers)]


def _resolve(calls: Sequence[tuple[str, Worker, Any]], step: int | None) -> list[Any]:
    """Every call's result, in order; raises one `ActorFailure` naming every member that failed
    (dead ones first) and those still running `FAILURE_GRACE_S` after the first failure."""
    unsettled = _settle([future for _, worker, future in calls if worker.is_actor])
    results: list[Any] = []
    failed: list[tuple[bool, str]] = []
    stuck: list[str] = []
    lost = False
    for label, worker, future in calls:
        if worker.is_actor and future in unsettled:
            stuck.append(label)
            continue
        try:
            results.append(worker.get(future, step=step))
        except ActorFailure as err:
            died = isinstance(err.__cause__, ray.exceptions.ActorDiedError)
            lost |= err.lost
            failed.append((not died, str(err).replace(worker.name, label, 1)))
    if stuck:
        failed.append((True, f"{', '.join(stuck)} still running {FAILURE_GRACE_S:g}s later"))
    if failed:
        # A member that died first: the others' errors (a closed connection) follow from it.
        reasons = [text for _, text in sorted(failed, key=lambda f: f[0])]
        # Members stuck in a collective whose peer is gone are lost with it.
        raise ActorFailure("weight sync failed: " + "; ".join(reasons), lost=lost or bool(stuck))
    return results


def _settle(futures: list[Any]) -> set[Any]:
    """Wait until every future is done, or `FAILURE_GRACE_S` after the first failed; returns the
    futures still running then."""
    pending = list(futures)
    deadline: float | None = None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            break
        if deadline is None and _failed(done[0]):
            deadline = time.monotonic() + FAILURE_GRACE_S
    return set(pending)


def _failed(future: Any) -> bool:
    try:
        ray.get(future)
    except ray.exceptions.RayError:
        return True
    return False


def _adopt_version(generator: Any, versions: list[int]) -> int:
    """The engines' one new weight version, also set as ``generator.weight_version``."""
    if len(set(versions)) != 1:
        labels = [label for label, _ in _labelled(generator.workers)]
        held = ", ".join(f"{label}: {v}" for label, v in zip(labels, versions, strict=True))
        raise RuntimeError(f"generation engines disagree on their weight version ({held})")
    generator.weight_version = versions[0]
    return versions[0]
