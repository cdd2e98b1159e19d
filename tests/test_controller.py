"""TrainingController: exactly-once step updates and exact state round trips."""

import json

import pytest

from rlvr.run.controller import StepOrderError, TrainingController


def test_plan_and_observe_once():
    c = TrainingController(group_size=4)
    plan = c.plan_step(0, ["a", "b"])
    assert plan["n"] == {"a": 4, "b": 4}
    assert c.observe_step(0, {"a": [1.0, 0.0, 1.0, 1.0], "b": [0.0] * 4}, {"reward": 0.375})
    assert c.prompts["a"].reward_mean == pytest.approx(0.75)
    # a retried call for the same step is a no-op
    assert not c.observe_step(0, {"a": [0.0] * 4}, {"reward": 0.0})
    assert c.prompts["a"].reward_mean == pytest.approx(0.75)
    assert c.prompts["a"].visits == 1
    assert len(c.history) == 1


def test_running_mean_across_steps():
    c = TrainingController(group_size=2)
    c.observe_step(0, {"a": [1.0, 1.0]}, {})
    c.observe_step(1, {"a": [0.0, 1.0]}, {})
    assert c.prompts["a"].reward_mean == pytest.approx(0.75)
    assert c.prompts["a"].visits == 2
    assert c.prompts["a"].last_step == 1


def test_gaps_are_rejected():
    c = TrainingController(group_size=2)
    with pytest.raises(StepOrderError):
        c.observe_step(1, {}, {})
    with pytest.raises(StepOrderError):
        c.plan_step(3, ["a"])


def test_state_dict_round_trip_is_json_and_exact():
    c = TrainingController(group_size=2, recent_rollouts_cap=3)
    for s in range(4):
        c.observe_step(s, {"a": [s / 3, 1.0]}, {"m": s}, rollouts=[{"r": s}, {"r": s + 0.5}])
    assert len(c.recent_rollouts) == 3
    state = json.loads(json.dumps(c.state_dict()))
    d = TrainingController(group_size=99)
    d.load_state_dict(state)
    assert d.state_dict() == c.state_dict()
    assert not d.observe_step(3, {"a": [0.0]}, {})
    assert d.observe_step(4, {"a": [0.0]}, {})


def test_laconic_dual_is_read_at_plan_and_stepped_once_per_step():
    from rlvr.methods.laconic.state import LaconicState

    c = TrainingController(group_size=2, method=LaconicState(budget=100, eta=0.1, lam_max=0.3))
    assert c.plan_step(0, ["a"])["laconic_lambda"] == 0.0
    assert c.update_method_state(0, mean_length=150.0) == pytest.approx(0.05)
    assert c.update_method_state(0, mean_length=999.0) == pytest.approx(0.05)  # a retry
    assert (
        c.plan_step(0, ["a"])["laconic_lambda"] == 0.0
    )  # a retried plan sees the step's own value
    c.observe_step(0, {"a": [1.0, 0.0]}, {})
    assert c.plan_step(1, ["a"])["laconic_lambda"] == pytest.approx(0.05)
    c.update_method_state(1, mean_length=50.0)  # below budget: decays and clips at 0
    assert c.method.dual.lam == 0.0
    with pytest.raises(ValueError):
        c.update_method_state(3, mean_length=100.0)  # a skipped step

    restored = TrainingController(group_size=2, method=LaconicState(budget=100))
    restored.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert restored.method.state_dict() == c.method.state_dict()
    with pytest.raises(ValueError, match="whether the method keeps state"):
        TrainingController(group_size=2).load_state_dict(c.state_dict())
