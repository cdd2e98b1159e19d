"""The rollout pipeline of `run.max_staleness: k`: every batch sampled by exactly policy version
max(0, s - k), in step order, from snapshots or pushes; its hand-over, checkpoint round trip,
evaluation on the current weights, errors and shutdown; and the config checks that keep it to
methods and layouts where generation can overlap training."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.versions import BoardClosed
from rlvr.config import ConfigError, load_config
from rlvr.methods.base import Collected
from rlvr.tasks import Problem
from workflows.rollout_pipeline import (
    PIPELINE_FILE,
    PipelineClosed,
    RolloutPipeline,
    SnapshotFeed,
    failed_ahead,
    partial_versions,
    sampling_version,
)
from workflows.workers import ActorFailure

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PROBLEMS = [Problem(id=f"p{i}", prompt=f"Compute {i} + 1.", answer=str(i + 1)) for i in range(3)]
GROUP = 4
SETTLE_S = 0.3
"""How long a test lets a batch that must stay blocked run before checking it did not finish."""


class SnapshotSync:
    """An object-store sync whose snapshots are the policy version they were exported at; the
    engines "hold" the last loaded one."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.engines: int | None = 0
        self.loads: list[int] = []

    def export(self, step):
        return self.policy_version

    def load(self, snapshot, step):
        self.engines = snapshot
        self.loads.append(snapshot)
        return len(self.loads)


class PushSync:
    """A collective sync: no snapshots; `push` loads the policy's current version."""

    def __init__(self, events: list) -> None:
        self.policy_version = 0
        self.engines = 0
        self.events = events

    def push(self, step):
        self.engines = self.policy_version
        self.events.append(("push", self.policy_version))


class RecordingMethod:
    """`collect` records the step, the thread and the version the engines held; the steps in
    `held` wait for `release`."""

    def __init__(
        self,
        sync,
        fail_at: int | None = None,
        events: list | None = None,
        error: Exception | None = None,
    ):
        """`error` (default: a RuntimeError "engine lost") is raised by step `fail_at`'s
        collection."""
        self.sync, self.fail_at = sync, fail_at
        self.error = error or RuntimeError("engine lost")
        self.calls: dict[int, dict] = {}
        self.held: set[int] = set()
        self.release = threading.Event()
        self.events = events if events is not None else []

    def collect(self, services, problems, plan, params, step, times):
        if step in self.held:
            assert self.release.wait(timeout=10)
        if step == self.fail_at:
            raise self.error
        self.calls[step] = {
            "plan": plan,
            "params": params,
            "engines": self.sync.engines,
            "thread": threading.get_ident(),
        }
        self.events.append(("collect", step))
        times["time_generate"] = 1.5
        return Collected(rollouts={"step": step}, trained={"step": step}, stats={"k": step})


def batch_of(step: int):
    return PROBLEMS, f"params-{step}", GROUP


PLAN = {p.id: GROUP for p in PROBLEMS}


@contextmanager
def pipeline(k: int, steps: int = 8, push: bool = False, **method_kwargs) -> Iterator:
    events: list = []
    sync = PushSync(events) if push else SnapshotSync()
    method = RecordingMethod(sync, events=events, **method_kwargs)
    pipe = RolloutPipeline(method, services=None, max_staleness=k, steps=steps, batch_of=batch_of)
    pipe.start(sync if not push else SimpleNamespace(), sync.push if push else None, 0)
    try:
        yield pipe, method, sync
    finally:
        pipe.close()


def train_step(pipe, sync, step: int) -> None:
    """What the trainer does around its update: take the step's batch, update, publish."""
    pipe.fill(step)
    assert pipe.take(step, PLAN).collected.stats == {"k": step}
    sync.policy_version = step + 1
    pipe.publish(step + 1, step)


def test_sampling_version_is_a_fixed_lag():
    assert [sampling_version(s, 0) for s in range(4)] == [0, 1, 2, 3]
    assert [sampling_version(s, 2) for s in range(5)] == [0, 0, 0, 1, 2]


@pytest.mark.parametrize(("k", "push"), [(1, False), (2, False), (3, False), (1, True)])
def test_every_batch_is_sampled_by_version_s_minus_k(k, push):
    steps = 6
    with pipeline(k, steps=steps, push=push) as (pipe, method, sync):
        for step in range(steps):
            train_step(pipe, sync, step)
    assert sorted(method.calls) == list(range(steps))
    for step, call in method.calls.items():
        assert call["engines"] == sampling_version(step, k), step
        assert call["params"] == f"params-{step}"
        assert call["plan"] == {"step": step, "n": PLAN}
        assert call["thread"] != threading.get_ident()


def test_a_batch_waits_for_its_version_and_runs_up_to_k_ahead():
    with pipeline(2) as (pipe, method, sync):
        pipe.fill(0)  # steps 0, 1, 2: all version 0, collected at once
        pipe.collected_before(1)
        assert sorted(method.calls) == [0, 1, 2]
        pipe.fill(1)  # step 3 needs version 1, which the policy does not hold yet
        time.sleep(SETTLE_S)
        assert 3 not in method.calls and pipe.ready() == 3
        sync.policy_version = 1
        pipe.publish(1, 0)
        pipe.collected_before(2)
        assert method.calls[3]["engines"] == 1


def test_pushes_wait_for_every_batch_of_an_older_version():
    """k = 1 over a collective sync: the next step's batch is collected during the update and
    the new weights reach the engines only after it (they must not change mid-batch)."""
    with pipeline(1, push=True) as (pipe, method, sync):
        method.held = {1}
        pipe.fill(0)  # steps 0 and 1, both version 0; step 1 held
        pipe.take(0, PLAN)
        sync.policy_version = 1
        publisher = threading.Thread(target=pipe.publish, args=(1, 0))
        publisher.start()
        time.sleep(SETTLE_S)
        assert ("push", 1) not in sync.events  # step 1's batch is still being collected
        method.release.set()
        publisher.join(timeout=10)
    assert sync.events == [("collect", 0), ("collect", 1), ("push", 1)]


def test_evaluation_holds_the_current_version_and_a_later_batch_reloads_its_own():
    """The driver evaluates on the policy's newest version while batches of older ones are
    still to come (the engines fell behind): each batch loads its own version back."""
    with pipeline(2) as (pipe, method, sync):
        for version in (1, 2):
            sync.policy_version = version
            pipe.publish(version, version - 1)
        with pipe.engines_at(2, step=1):
            assert sync.engines == 2
        pipe.fill(0)  # steps 0-2, all sampled by version 0
        pipe.collected_before(1)
        assert [method.calls[s]["engines"] for s in range(3)] == [0, 0, 0]
    assert sync.loads == [2, 0]


def test_snapshots_are_released_once_no_batch_needs_them():
    with pipeline(1) as (pipe, method, sync):
        for step in range(4):
            train_step(pipe, sync, step)
        pipe.fill(4)  # steps 4 and 5, of versions 3 and 4
        pipe.collected_before(5)
        assert sorted(pipe.feed.snapshots) == [4]  # step 5 loaded 4, the policy's own


def test_publishing_while_the_pipeline_releases_snapshots_is_safe():
    """The driver publishes (inserts a snapshot) while the pipeline thread releases old ones
    (iterates them). Switching threads every microsecond makes an unguarded insert land inside
    the iteration on almost every try ("dictionary changed size during iteration")."""
    feed = SnapshotFeed(SnapshotSync())
    for version in range(2000):  # a long dict: each release iterates it for a while
        feed.publish(version, None)
    published = threading.Event()
    errors: list[BaseException] = []
    releases = 0

    def release() -> None:
        nonlocal releases
        while not published.is_set():
            try:
                feed.release_before(0)  # iterates every snapshot, releases none
            except RuntimeError as err:
                errors.append(err)
                return
            releases += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    releaser = threading.Thread(target=release)
    try:
        releaser.start()
        for version in range(2000, 12000):
            feed.publish(version, None)
    finally:
        published.set()
        releaser.join(timeout=10)
        sys.setswitchinterval(interval)
    assert errors == []
    assert releases > 0, "the releases never overlapped the publishing"
    assert sorted(feed.snapshots) == list(range(12000))


def test_a_plan_that_differs_from_what_was_collected_fails():
    with pipeline(1) as (pipe, _, _sync):
        pipe.fill(0)
        with pytest.raises(RuntimeError, match="planned"):
            pipe.take(0, {"p0": 4, "p1": 4, "p2": 2})


def test_an_error_of_the_collection_surfaces_on_take():
    with pipeline(1, fail_at=1) as (pipe, _, sync):
        train_step(pipe, sync, 0)
        pipe.fill(1)
        with pytest.raises(RuntimeError, match="engine lost"):
            pipe.take(1, PLAN)


LOST = "GeneratorActor 1 failed at step 3: RayActorError: The actor died unexpectedly"


def test_a_failure_sampled_ahead_names_the_batch_s_step_and_the_training_step():
    err = failed_ahead(ActorFailure(LOST, lost=True), batch_step=3, training_step=1)
    assert str(err) == f"{LOST} (step 3's rollouts, sampled ahead during training step 1)"
    assert isinstance(err, ActorFailure) and err.lost  # still recovered as a lost actor
    assert not failed_ahead(ActorFailure(LOST), batch_step=3, training_step=1).lost


def test_a_lost_engine_sampling_ahead_surfaces_at_the_checkpoint_naming_both_steps(tmp_path):
    """k = 2: step 3's batch (version 1) is collected during step 1; its lost engine surfaces
    when step 1's checkpoint waits for it."""
    with pipeline(2, fail_at=3, error=ActorFailure(LOST, lost=True)) as (pipe, _, sync):
        for step in range(2):
            train_step(pipe, sync, step)
        with pytest.raises(ActorFailure) as failure:
            pipe.save(tmp_path, version=2)
    assert failure.value.lost
    assert str(failure.value).endswith("(step 3's rollouts, sampled ahead during training step 1)")
    with pipeline(1, fail_at=1, error=ActorFailure(LOST, lost=True)) as (pipe, _, sync):
        train_step(pipe, sync, 0)
        pipe.fill(1)
        with pytest.raises(ActorFailure, match=f"^{LOST}$"):  # taken at its own step
            pipe.take(1, PLAN)


def test_close_ends_a_batch_waiting_for_its_version():
    with pipeline(1) as (pipe, _, _sync):
        pipe.fill(0)
        pipe.take(0, PLAN)
        pipe.fill(1)
        pipe.collected_before(1)
        pipe.fill(2)  # needs version 1, never published
        waiting = pipe.batches[2].future
    assert isinstance(waiting.exception(timeout=5), PipelineClosed)


def test_checkpoint_round_trip(tmp_path):
    """The checkpoint of step 1 (version 2) with k = 2 holds steps 2 and 3 (versions 0 and 1);
    step 4, of version 2, is collected again from the checkpoint's weights."""
    with pipeline(2) as (pipe, method, sync):
        for step in range(2):
            train_step(pipe, sync, step)
        pipe.fill(2)  # through step 4
        pipe.save(tmp_path, version=2)
    with pipeline(2) as (restored, method2, sync2):
        restored.load(tmp_path, last_step=1)
        assert sorted(restored.batches) == [2, 3]
        sync2.policy_version = sync2.engines = 2
        restored.start(sync2, None, 2)
        restored.fill(2)
        for step in (2, 3):
            assert restored.take(step, PLAN).collected.stats == {"k": step}
        restored.collected_before(3)
        assert sorted(method2.calls) == [4] and method2.calls[4]["engines"] == 2

    with pipeline(1, steps=2) as (pipe, _, sync):
        train_step(pipe, sync, 0)
        train_step(pipe, sync, 1)
        pipe.save(tmp_path / "last", version=2)  # the last step: nothing ahead
        assert not (tmp_path / "last" / PIPELINE_FILE).exists()


@pytest.mark.parametrize(
    ("preset", "overrides", "message"),
    [
        ("tiny-duet.yaml", [], "duet plans each step's rollouts"),
        ("tiny-dro.yaml", [], "dro plans each step's rollouts"),
        (
            "tiny.yaml",
            [
                "resources.colocate=true",
                "resources.policy_ranks=1",
                "resources.generator_engines=1",
            ],
            "resources.colocate",
        ),
        ("tiny.yaml", ["run.max_staleness=2", "sync.transport=collective"], "object_store"),
    ],
)
def test_staleness_is_refused_where_generation_cannot_overlap(preset, overrides, message):
    with pytest.raises(ConfigError, match=f"run.max_staleness: .*{message}"):
        load_config(CONFIGS / preset, ["run.max_staleness=1", *overrides])


def test_staleness_needs_the_engine_importance_weights():
    """Stale rollouts are corrected only by the engine importance weights: without them the run
    would train on them as if they were on-policy."""
    with pytest.raises(ConfigError, match="run.max_staleness: .*training.engine_is: off"):
        load_config(CONFIGS / "tiny.yaml", ["run.max_staleness=1", "training.engine_is=off"])


def test_the_old_key_names_its_replacement():
    with pytest.raises(ConfigError, match="off_policy_steps is now run.max_staleness"):
        load_config(CONFIGS / "tiny.yaml", ["run.off_policy_steps=1"])


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("tiny.yaml", []),
        ("tiny.yaml", ["algorithm.name=laconic", "algorithm.laconic.budget=12"]),
        ("tiny.yaml", ["algorithm.name=dapo"]),
        ("tiny-tandem.yaml", []),
        ("tiny-tandem.yaml", ["algorithm.tandem.junior=separate"]),
    ],
)
def test_staleness_is_accepted_for_methods_that_overlap(preset, overrides):
    assert load_config(CONFIGS / preset, ["run.max_staleness=4", *overrides]).run.max_staleness
    with pytest.raises(ConfigError, match="run.max_staleness"):
        load_config(CONFIGS / preset, ["run.max_staleness=17", *overrides])


def test_auto_transport_holds_snapshots_from_staleness_two():
    from workflows.weight_sync import make_weight_sync

    actor = SimpleNamespace(is_actor=True, name="w")
    group = SimpleNamespace(workers=[actor])
    cfg = load_config(CONFIGS / "tiny.yaml", ["run.max_staleness=2"])
    assert make_weight_sync(cfg, group, group).transport == "object_store"


def test_overlapped_roles_share_the_cores(monkeypatch):
    from workflows.components import torch_threads

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    on_policy = load_config(CONFIGS / "tiny.yaml", ["resources.policy_ranks=2"])
    assert torch_threads(on_policy, on_policy.resources.policy_ranks) == 4  # phases take turns
    overlapped = load_config(
        CONFIGS / "tiny.yaml", ["resources.policy_ranks=2", "run.max_staleness=1"]
    )
    assert torch_threads(overlapped, 2) == 8 // 3  # 2 ranks and 1 engine compute at once
    pinned = load_config(
        CONFIGS / "tiny.yaml", ["run.max_staleness=1", "resources.torch_threads=3"]
    )
    assert torch_threads(pinned, 1) == 3
    juniors = load_config(
        CONFIGS / "tiny-tandem.yaml", ["run.max_staleness=1", "algorithm.tandem.junior=separate"]
    )
    assert torch_threads(juniors, 1) == 8 // 3  # a rank, an engine and its junior at once


class PartialPool:
    """The engines of a partial-rollout pipeline: they record the versions each batch begins
    with (in-process, so the board is a plain `VersionBoard`)."""

    workers: list = []

    def __init__(self) -> None:
        self.begun: list[tuple[int, tuple[int, int]]] = []
        self.board = None

    def run(self, method, *args, step=None):
        if method == "begin_partial":
            tokens, versions, self.board = args
            self.begun.append((tokens, versions))
        return 0.25 if method == "end_partial" else None  # the engines' longest version wait


def test_partial_versions_move_one_version_at_most():
    assert [partial_versions(s, 2) for s in range(5)] == [(0, 0), (0, 0), (0, 1), (1, 2), (2, 3)]
    assert [partial_versions(s, 1) for s in range(3)] == [(0, 0), (0, 1), (1, 2)]


def test_partial_batches_begin_on_their_versions_and_post_every_snapshot():
    sync = SnapshotSync()
    sync.generator = PartialPool()
    method = RecordingMethod(sync)
    pipe = RolloutPipeline(
        method, None, max_staleness=2, steps=6, batch_of=batch_of, partial_tokens=7
    )
    pipe.start(sync, None, 0)
    try:
        pipe.fill(0)
        assert pipe.batches[0].finish(0) is None and pipe.batches[0].times == {
            "time_generate": 1.5,
            "time_wait_version": 0.25,
        }
        for step in range(6):
            train_step(pipe, sync, step)
        begun = sync.generator.begun
        assert begun == [(7, partial_versions(s, 2)) for s in range(6)]
        # each batch begins on the version the one before ended on: nothing is loaded between
        # them (the engines loaded each second version themselves, from the board)
        assert sync.loads == []
        board = sync.generator.board
        assert board.snapshot(5) == [5] and board.snapshot(6) == [6]
        with pytest.raises(KeyError):  # released: no batch begins below version 3 any more
            board._snapshots[2]
    finally:
        pipe.close()
    with pytest.raises(BoardClosed):
        board.snapshot(99)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], "set run.max_staleness >= 1"),
        (["run.max_staleness=1", "sync.transport=collective"], "object-store snapshot"),
        (["run.max_staleness=1", "generation.stop=[Q]"], "generation.stop must be empty"),
        (["run.max_staleness=1", "generation.engine_loop=batch"], "cannot pause a request"),
        (["run.max_staleness=1", "algorithm.name=tandem"], "tandem keeps per-sample state"),
    ],
)
def test_partial_rollouts_are_refused_where_a_turn_cannot_be_continued(overrides, message):
    with pytest.raises(ConfigError, match=f"run.partial_rollout_tokens: .*{message}"):
        load_config(CONFIGS / "tiny.yaml", ["run.partial_rollout_tokens=16", *overrides])


def test_partial_rollouts_hold_snapshots_from_staleness_one():
    from workflows.weight_sync import make_weight_sync

    actor = SimpleNamespace(is_actor=True, name="w")
    group = SimpleNamespace(workers=[actor])
    cfg = load_config(
        CONFIGS / "tiny.yaml", ["run.max_staleness=1", "run.partial_rollout_tokens=8"]
    )
    assert make_weight_sync(cfg, group, group).transport == "object_store"
