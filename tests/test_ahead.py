"""Collecting the next step's rollouts ahead (`run.off_policy_steps: 1`): the collector's hand-over,
its checkpoint round trip and errors, and the config checks that keep it to methods and layouts
where generation can overlap training."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rlvr.config import ConfigError, load_config
from rlvr.methods.base import Collected
from rlvr.tasks import Problem
from workflows.ahead import AHEAD_FILE, AheadCollector

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PROBLEMS = [Problem(id=f"p{i}", prompt=f"Compute {i} + 1.", answer=str(i + 1)) for i in range(3)]


class RecordingMethod:
    """A method whose `collect` records its arguments and the thread it ran on; `gate` holds it
    until the test releases it."""

    def __init__(self, fail: bool = False):
        self.calls: list[dict] = []
        self.gate = threading.Event()
        self.fail = fail

    def collect(self, run, problems, plan, params, step, times):
        self.gate.wait(timeout=10)
        self.calls.append(
            {"plan": plan, "params": params, "step": step, "thread": threading.get_ident()}
        )
        if self.fail:
            raise RuntimeError("engine lost")
        times["time_generate"] = 1.5
        return Collected(rollouts={"step": step}, trained={"step": step}, stats={"k": step})


@contextmanager
def released_collector(fail: bool = False) -> Iterator[AheadCollector]:
    """A collector over a `RecordingMethod` that collects at once; closed on exit."""
    method = RecordingMethod(fail=fail)
    method.gate.set()
    ahead = AheadCollector(method, services=None)
    try:
        yield ahead
    finally:
        ahead.close()


def test_launch_collects_in_another_thread_and_take_hands_it_over():
    method = RecordingMethod()
    ahead = AheadCollector(method, services=None)
    ahead.launch(4, PROBLEMS, params="params-4", group_size=8)
    assert ahead.pending.future is not None and not method.calls  # still running
    method.gate.set()
    got = ahead.take(4, {p.id: 8 for p in PROBLEMS})
    assert got.collected.rollouts == {"step": 4} and got.times == {"time_generate": 1.5}
    (call,) = method.calls
    assert call["plan"] == {"step": 4, "n": {"p0": 8, "p1": 8, "p2": 8}}
    assert call["params"] == "params-4" and call["step"] == 4
    assert call["thread"] != threading.get_ident()
    assert ahead.pending is None
    ahead.close()


def test_take_of_another_step_or_nothing_pending_is_none():
    with released_collector() as ahead:
        assert ahead.take(0, {}) is None
        ahead.launch(2, PROBLEMS, params=None, group_size=4)
        assert ahead.take(3, {p.id: 4 for p in PROBLEMS}) is None  # dropped: not step 3's
        assert ahead.pending is None


def test_a_plan_that_differs_from_what_was_collected_fails():
    with released_collector() as ahead:
        ahead.launch(1, PROBLEMS, params=None, group_size=4)
        with pytest.raises(RuntimeError, match="planned"):
            ahead.take(1, {"p0": 4, "p1": 4, "p2": 2})


def test_an_error_of_the_collection_surfaces_on_wait():
    with released_collector(fail=True) as ahead:
        ahead.launch(1, PROBLEMS, params=None, group_size=4)
        with pytest.raises(RuntimeError, match="engine lost"):
            ahead.wait()


def test_checkpoint_round_trip(tmp_path):
    with released_collector() as ahead:
        ahead.save(tmp_path)  # nothing pending: nothing written
        assert not (tmp_path / AHEAD_FILE).exists()
        ahead.launch(6, PROBLEMS, params=None, group_size=4)
        ahead.save(tmp_path)  # waits for the collection, then writes it

    with released_collector() as restored:
        restored.load(tmp_path)
        got = restored.take(6, {p.id: 4 for p in PROBLEMS})
        assert got.collected.stats == {"k": 6} and got.times == {"time_generate": 1.5}
        restored.load(tmp_path / "missing")  # a checkpoint without one: the next step collects
        assert restored.pending is None


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
    ],
)
def test_off_policy_is_refused_where_generation_cannot_overlap(preset, overrides, message):
    with pytest.raises(ConfigError, match=f"run.off_policy_steps: .*{message}"):
        load_config(CONFIGS / preset, ["run.off_policy_steps=1", *overrides])


def test_off_policy_needs_the_engine_importance_weights():
    """Rollouts one update stale are corrected only by the engine importance weights: without
    them the run would train on them as if they were on-policy."""
    with pytest.raises(ConfigError, match="run.off_policy_steps: .*training.engine_is: off"):
        load_config(CONFIGS / "tiny.yaml", ["run.off_policy_steps=1", "training.engine_is=off"])


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("tiny.yaml", []),
        ("tiny.yaml", ["algorithm.name=laconic", "algorithm.laconic.budget=12"]),
        ("tiny.yaml", ["algorithm.name=dapo"]),
        ("tiny-tandem.yaml", []),
    ],
)
def test_off_policy_is_accepted_for_methods_that_overlap(preset, overrides):
    assert load_config(
        CONFIGS / preset, ["run.off_policy_steps=1", *overrides]
    ).run.off_policy_steps
    with pytest.raises(ConfigError, match="run.off_policy_steps"):
        load_config(CONFIGS / preset, ["run.off_policy_steps=2", *overrides])


def test_overlapped_roles_share_the_cores(monkeypatch):
    from workflows.components import torch_threads

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    on_policy = load_config(CONFIGS / "tiny.yaml", ["resources.policy_ranks=2"])
    assert torch_threads(on_policy, on_policy.resources.policy_ranks) == 4  # phases take turns
    overlapped = load_config(
        CONFIGS / "tiny.yaml", ["resources.policy_ranks=2", "run.off_policy_steps=1"]
    )
    assert torch_threads(overlapped, 2) == 8 // 3  # 2 ranks and 1 engine compute at once
    pinned = load_config(
        CONFIGS / "tiny.yaml", ["run.off_policy_steps=1", "resources.torch_threads=3"]
    )
    assert torch_threads(pinned, 1) == 3
