"""DUET's controller: plans and state updates applied exactly once per step, exact JSON round trips,
the step metrics, the weighted/masked training batch and the config section."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rlvr.algorithms.duet.control import DuetController, step_metrics
from rlvr.config import ConfigError, load_config
from rlvr.methods.base import build_method
from rlvr.methods.duet.config import duet_controller, duet_stop
from rlvr.methods.duet.shaping import shape_duet
from rlvr.methods.duet.state import DuetState
from rlvr.run.controller import StepOrderError, TrainingController
from rlvr.training.rollouts import Rollouts

IDS = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
# a: all kept, A * logp = [-2, 4, -6, 8] -> population std sqrt(29); b: one kept (no surrogate);
# c: all rewards equal -> A = 0 -> surrogate exactly 0.
ADV = [1.0, -1.0, 1.0, -1.0, 0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
LOGP = [-2.0, -4.0, -6.0, -8.0, -1.0, -1.0, -1.0, -1.0, -3.0, -3.0, -3.0, -3.0]
LENGTHS = [10, 20, 30, 40, 12, 60, 60, 60, 50, 50, 50, 50]
KEPT = [True] * 5 + [False] * 3 + [True] * 4


OBSERVATION = {
    "prompt_ids": IDS,
    "advantages": ADV,
    "logprob_sums": LOGP,
    "lengths": LENGTHS,
    "kept": KEPT,
}


def controller(**kwargs) -> DuetController:
    return DuetController(**{"b": 0.5, "max_len": 100, "n_ref": 8, **kwargs})


def controller_state(**kwargs) -> DuetState:
    """DUET's state as the training controller holds it."""
    return DuetState(**{"b": 0.5, "max_len": 100, "n_ref": 8, **kwargs})


def run_step0(c: DuetController, epoch_end: bool = False) -> dict:
    c.plan(0, ["a", "b", "c"])
    return c.update(0, IDS, ADV, LOGP, LENGTHS, KEPT, epoch_end)


def test_cold_plan_is_uniform_at_b_times_n_ref():
    plan = controller().plan(0, ["a", "b", "c"])
    # every prompt cold: s_hat = 0.01, L_hat = max_len; B = 0.5 * 8 * 300
    assert plan["counts"] == [4, 4, 4]
    assert plan["budget"] == 1200.0
    assert plan["planned_tokens"] == 1200.0
    assert plan["s_pre"] == [1.0, 1.0, 1.0]
    assert (plan["k1"], plan["k2"]) == (30, 70)  # 0.3 and 0.7 of max_len
    # the smallest dual with round(s / sqrt(lambda L)) <= 4: s / sqrt(lambda L) = 4.5 (ties to even)
    assert plan["lambda"] == pytest.approx(0.01**2 / (100 * 4.5**2), rel=1e-9)


def test_update_then_plan_uses_the_observed_state():
    c = controller()
    metrics = run_step0(c)
    assert metrics["duet_surrogate_updates"] == 2  # a and c; b has one kept rollout
    assert metrics["duet_sigma_obs_mean"] == pytest.approx(math.sqrt(29) / 2)
    # chi^2 of the plan's s_hat (0.01, cold) against sigma_t (sqrt 29, and 0 floored at 1e-6)
    expected = ((0.01 / math.sqrt(29) - 1) ** 2 + (0.01 / 1e-6 - 1) ** 2) / 2
    assert metrics["duet_calibration_chi2"] == pytest.approx(expected, rel=1e-12)
    assert metrics["duet_prompts_tracked"] == 3
    assert c.prompts.observed("a")["sigma"] == pytest.approx(math.sqrt(29))
    assert c.prompts.observed("b")["length"] == 12.0  # the aborted rollouts do not count
    assert list(c.window.lengths) == [10, 20, 30, 40, 12, 50, 50, 50, 50]
    assert c.lam == pytest.approx(0.01**2 / (100 * 4.5**2), rel=1e-9)

    plan = c.plan(1, ["a", "b", "c", "d"])
    # s_hat: a sqrt(29); b, c, d 0.01. L_hat: 25, 12, 50, window mean 312/9 (d is cold).
    assert plan["s_hat"] == pytest.approx([math.sqrt(29), 0.01, 0.01, 0.01])
    assert plan["l_hat"] == pytest.approx([25.0, 12.0, 50.0, 312 / 9])
    budget = 0.5 * 8 * (25 + 12 + 50 + 312 / 9)
    assert plan["budget"] == pytest.approx(budget)
    # b, c, d stay at n_min (raising them needs a dual at which a gets n_max, over budget);
    # a takes what is left: floor((B - 96.67) / 25) = 15
    assert plan["counts"] == [15, 1, 1, 1]
    assert plan["planned_tokens"] == pytest.approx(15 * 25 + 12 + 50 + 312 / 9)
    assert plan["s_pre"] == pytest.approx([1.0, 1 / 4.5, 1 / 4.5, 1 / 4.5])


def test_plans_and_updates_apply_exactly_once():
    c = controller()
    with pytest.raises(ValueError, match="before its plan"):
        c.update(0, IDS, ADV, LOGP, LENGTHS, KEPT)
    first = c.plan(0, ["a", "b", "c"])
    assert c.plan(0, ["a", "b", "c"]) is first  # a retried plan is the same plan
    with pytest.raises(ValueError, match="other prompts"):
        c.plan(0, ["a", "b"])
    metrics = c.update(0, IDS, ADV, LOGP, LENGTHS, KEPT)
    state = json.dumps(c.state_dict())
    # a retry (even with other data) returns the recorded metrics and changes nothing
    assert c.update(0, IDS, [0.0] * 12, LOGP, [1] * 12, [True] * 12) is metrics
    assert json.dumps(c.state_dict()) == state
    assert c.prompts.observed("a")["visits"] == 1
    assert c.plan(0, ["a", "b", "c"]) is first  # still the step's plan
    with pytest.raises(ValueError, match="next step is 1"):
        c.update(2, IDS, ADV, LOGP, LENGTHS, KEPT)
    with pytest.raises(ValueError, match="next step is 1"):
        c.plan(2, ["a"])
    c.plan(1, ["a"])
    with pytest.raises(ValueError, match="next step is 1"):
        c.plan(0, ["a", "b", "c"])


def test_a_step_holding_a_prompt_twice_is_refused():
    c = controller()
    # one count per prompt id: two copies of "a" would get one count and merge into one group
    with pytest.raises(ValueError, match=r"step 0 holds prompts \['a'\] more than once"):
        c.plan(0, ["a", "b", "a"])
    c.plan(0, ["a", "b", "c"])  # nothing was planned: the step plans as usual
    ids = ["a"] * 2 + ["b"] * 4 + ["c"] * 4 + ["a"] * 2  # a's rollouts in two groups
    with pytest.raises(ValueError, match="two separate runs"):
        c.update(0, ids, ADV, LOGP, LENGTHS, KEPT)
    assert c.last_step == -1 and len(c.prompts) == 0
    with pytest.raises(ValueError, match="more than once"):
        TrainingController(group_size=8, method=controller_state()).plan_step(0, ["a", "a"])


def test_epoch_end_freezes_the_floor_at_p5():
    c = controller()
    metrics = run_step0(c, epoch_end=True)
    # sigma over observed prompts {sqrt 29, 0}: numpy's linear p5 = 0.05 * sqrt(29)
    assert metrics["duet_s_floor"] == pytest.approx(0.05 * math.sqrt(29))
    assert c.prompts.floor_frozen and c.prompts.epoch == 2
    assert c.plan(1, ["b"])["s_hat"] == pytest.approx([0.05 * math.sqrt(29)])


def test_state_round_trips_through_json_and_plans_identically():
    c = controller()
    run_step0(c)
    restored = controller()
    restored.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert restored.state_dict() == c.state_dict()
    ids = ["c", "d", "a", "b"]
    a, b = c.plan(1, ids), restored.plan(1, ids)
    assert {k: v for k, v in a.items() if k != "time_duet_plan"} == {
        k: v for k, v in b.items() if k != "time_duet_plan"
    }


def test_training_controller_routes_duet_and_guards_the_observation():
    c = TrainingController(group_size=8, method=controller_state())
    plan = c.plan_step(0, ["a", "b", "c"])
    assert plan["n"] == {"a": 4, "b": 4, "c": 4}
    assert plan["duet"]["counts"] == [4, 4, 4]
    with pytest.raises(StepOrderError, match="before its method state update"):
        c.observe_step(0, {}, {})
    c.update_method_state(0, **OBSERVATION)
    assert c.observe_step(0, {"a": [1.0]}, {})
    assert not c.observe_step(0, {"a": [1.0]}, {})

    restored = TrainingController(group_size=8, method=controller_state())
    restored.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert restored.state_dict() == c.state_dict()
    assert restored.plan_step(1, ["a", "d"])["n"] == c.plan_step(1, ["a", "d"])["n"]
    with pytest.raises(ValueError, match="whether the method keeps state"):
        TrainingController(group_size=8).load_state_dict(c.state_dict())
    with pytest.raises(RuntimeError, match="keeps no controller state"):
        TrainingController(group_size=8).update_method_state(0)


def test_step_metrics_hand_computed():
    plan = {
        "counts": [2, 1],
        "lambda": 0.25,
        "budget": 100.0,
        "planned_tokens": 90.0,
        "k1": 5,
        "k2": 9,
        "s_hat": [1.0, 3.0],
        "l_hat": [30.0, 40.0],
        "time_duet_plan": 0.001,
    }
    flags = [{"marker": True}, {"aborted": True}, {"eps_kept": True}]
    m = step_metrics(plan, flags, [1.0, 0.0, 20.0], [10, 30, 40], n_min=1, n_max=32)
    assert (m["duet_n_mean"], m["duet_n_std"], m["duet_n_min"], m["duet_n_max"]) == (1.5, 0.5, 1, 2)
    assert m["duet_at_n_min_frac"] == 0.5 and m["duet_at_n_max_frac"] == 0.0
    assert m["duet_n_hist"] == {"1": 1, "2": 1}
    assert m["duet_realised_tokens"] == 80
    assert m["duet_tokens_saved"] == 20.0 and m["duet_tokens_saved_frac"] == pytest.approx(0.2)
    assert m["duet_marker_rate"] == m["duet_eps_kept_rate"] == m["duet_abort_rate"] == 1 / 3
    assert m["duet_weight_mean"] == 10.5 and m["duet_weight_max"] == 20.0
    assert (m["duet_k1"], m["duet_k2"], m["duet_lambda"]) == (5, 9, 0.25)
    assert m["duet_s_hat_mean"] == 2.0 and m["duet_l_hat_mean"] == 35.0


def test_shape_duet_weights_advantages_and_masks_aborted_rollouts():
    cfg = load_config(None, ["algorithm.name=duet", "algorithm.duet.grace=8"])
    rollouts = Rollouts(
        group_ids=["p", "p", "q", "q"],
        prompt_ids=[[1, 2]] * 4,
        response_ids=[[3, 4], [5, 6, 7], [8], [9, 10]],
        texts=["x"] * 4,
        golds=["1"] * 4,
        finish_reasons=["stop"] * 4,
        flags=[{}, {"aborted": True}, {"marker": True}, {"eps_kept": True}],
        rewards=np.array([1.0, 0.0, 0.0, 1.0]),
    )
    batch, stats = shape_duet(rollouts, [2, 2], cfg, pad_id=0)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO over both rows, the aborted one included
    assert rollouts.advantages == pytest.approx([a, -a, -a, a], rel=1e-12)
    # s_pre = 1 for both prompts; eps-kept gets 1 / eps_abort = 20; aborted 0
    assert rollouts.weights.tolist() == [1.0, 0.0, 1.0, 20.0]
    assert batch.advantages.tolist() == pytest.approx([a, 0.0, -a, 20 * a], rel=1e-6)
    assert batch.response_mask.sum(dim=1).tolist() == [2, 0, 1, 2]
    assert stats["nonzero_advantage_frac"] == 0.75
    records = rollouts.records(0)
    assert records[1]["flags"] == {"aborted": True} and records[1]["weight"] == 0.0
    assert "flags" not in records[0] and records[3]["weight"] == 20.0


def test_config_defaults_and_controller_kwargs():
    cfg = load_config(None, ["algorithm.name=duet", "generation.max_tokens=512"])
    du = cfg.algorithm.duet
    assert (du.b, du.n_ref, du.n_min, du.n_max, du.eps_pre, du.eps_abort) == (
        0.5,
        8,
        1,
        32,
        0.05,
        0.05,
    )
    assert (du.grace, du.poll_every, du.marker_window, du.domain, du.k_warmup) == (
        150,
        8,
        256,
        "math",
        1,
    )
    kwargs = duet_controller(cfg)
    assert kwargs["max_len"] == 512 and kwargs["refit_every"] == 10
    assert DuetController(**kwargs).window.k2 == int(0.7 * 512)
    assert build_method(load_config(None, [])).controller_state() is None
    stop = duet_stop(cfg, k1=10, k2=20, step=3)
    assert stop == {
        "k1": 10,
        "k2": 20,
        "base_seed": 0,
        "step": 3,
        "domain": "math",
        "grace": 150,
        "eps_abort": 0.05,
        "poll_every": 8,
        "window": 256,
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.name=duet", "algorithm.duet.n_ref=40"], r"algorithm\.duet: n_ref=40"),
        (
            ["algorithm.name=duet", "algorithm.duet.n_min=4", "algorithm.duet.n_ref=4"],
            r"algorithm\.duet: b=0\.5",
        ),
        (["algorithm.name=duet", "algorithm.duet.eps_abort=1.5"], r"algorithm\.duet\.eps_abort"),
        (["algorithm.name=duet"], r"algorithm\.duet\.grace=150"),
        (
            ["algorithm.name=duet", "algorithm.duet.grace=8", "algorithm.duet.k1_min=300"],
            r"algorithm\.duet\.k1_min",
        ),
        (
            [
                "algorithm.name=duet",
                "algorithm.duet.grace=8",
                "algorithm.advantage_scale=none",
            ],
            r"algorithm\.advantage_scale",
        ),
    ],
)
def test_bad_duet_config_names_the_key(overrides, message):
    # generation.max_tokens defaults to 256, so the paper's grace 150 only passes with more room
    overrides = list(overrides) + (
        ["generation.max_tokens=128"] if "algorithm.name=duet" in overrides else []
    )
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
