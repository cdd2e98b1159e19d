"""DUET's ablation switches: allocator-only (no stop rule in the engine, weights 1 / s_pre) and
abort-only (round(b * n_ref) rollouts per prompt, s_pre = 1, weights 1 / p_abort), with
hand-computed plans and weights, and the config checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlvr.algorithms.duet import fixed_count
from rlvr.algorithms.duet.control import DuetController
from rlvr.config import ConfigError, load_config
from rlvr.methods.duet.config import duet_controller, duet_stop
from rlvr.methods.duet.shaping import shape_duet
from rlvr.training.rollouts import Rollouts

# The step-0 data of test_duet_control: after it, prompt a has sigma sqrt(29), L_hat 25.
IDS = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
ADV = [1.0, -1.0, 1.0, -1.0, 0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
LOGP = [-2.0, -4.0, -6.0, -8.0, -1.0, -1.0, -1.0, -1.0, -3.0, -3.0, -3.0, -3.0]
LENGTHS = [10, 20, 30, 40, 12, 60, 60, 60, 50, 50, 50, 50]
KEPT = [True] * 5 + [False] * 3 + [True] * 4
BASE = ["generation.max_tokens=64", "algorithm.name=duet", "algorithm.duet.grace=8"]


def stepped(**kwargs) -> DuetController:
    c = DuetController(b=0.5, max_len=100, n_ref=8, **kwargs)
    c.plan(0, ["a", "b", "c"])
    c.update(0, IDS, ADV, LOGP, LENGTHS, KEPT)
    return c


def test_abort_only_plans_fixed_counts_with_unit_s_pre():
    c = stepped(allocate=False)
    plan = c.plan(1, ["a", "b", "c", "d"])
    # the allocator would give [15, 1, 1, 1] here (test_duet_control); without it: 0.5 * 8 each
    assert plan["counts"] == [4, 4, 4, 4]
    assert plan["lambda"] is None
    assert plan["s_pre"] == [1.0, 1.0, 1.0, 1.0]
    l_hat = [25.0, 12.0, 50.0, 312 / 9]
    assert plan["budget"] == pytest.approx(0.5 * 8 * sum(l_hat))
    assert plan["planned_tokens"] == pytest.approx(4 * sum(l_hat))
    assert (plan["k1"], plan["k2"]) == (30, 70)  # the stop rule's thresholds are still planned
    assert c.prompts.observed("a")["sigma"] == pytest.approx(math.sqrt(29))  # state still kept
    quarter = DuetController(b=0.25, max_len=100, n_ref=8, allocate=False)
    assert quarter.plan(0, ["a", "b"])["counts"] == [2, 2]


def test_allocate_default_is_the_neyman_plan():
    assert stepped().plan(1, ["a", "b", "c", "d"])["counts"] == [15, 1, 1, 1]


def test_fixed_count_rounds_half_to_even_and_checks_bounds():
    assert (fixed_count(0.25, 8), fixed_count(0.3, 8), fixed_count(0.3125, 8)) == (2, 2, 2)
    assert fixed_count(0.5625, 4) == 2  # 2.25
    with pytest.raises(ValueError, match=r"b=5: round\(b \* n_ref\) = 40"):
        fixed_count(5, 8, 1, 32)


def _rollouts(groups, flags, rewards) -> Rollouts:
    n = len(groups)
    return Rollouts(
        group_ids=groups,
        prompt_ids=[[1, 2]] * n,
        response_ids=[[3, 4]] * n,
        texts=["x"] * n,
        golds=["1"] * n,
        finish_reasons=["stop"] * n,
        flags=flags,
        rewards=np.array(rewards, dtype=np.float64),
    )


def test_abort_only_weights_are_one_over_p_abort():
    cfg = load_config(None, [*BASE, "algorithm.duet.allocate=false", "algorithm.duet.b=0.25"])
    assert duet_stop(cfg, k1=10, k2=20, step=0) is not None  # the stop rule stays on
    assert duet_controller(cfg)["allocate"] is False
    counts = DuetController(**duet_controller(cfg)).plan(0, ["p", "q"])["counts"]
    assert counts == [2, 2]
    flags = [{"marker": True}, {"eps_kept": True}, {"aborted": True}, {}]
    rollouts = _rollouts(["p", "p", "q", "q"], flags, [1.0, 0.0, 0.0, 1.0])
    batch, _ = shape_duet(rollouts, counts, cfg, pad_id=0)
    # s_pre = 1: marker 1, eps-kept 1 / 0.05, aborted 0, natural 1
    assert rollouts.weights.tolist() == [1.0, 20.0, 0.0, 1.0]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert batch.advantages.tolist() == pytest.approx([a, -20 * a, 0.0, a], rel=1e-6)
    assert batch.response_mask.sum(dim=1).tolist() == [2, 2, 0, 2]


def test_allocator_only_installs_no_stop_rule_and_weights_one_over_s_pre():
    cfg = load_config(None, [*BASE, "algorithm.duet.early_stop=false"])
    assert duet_stop(cfg, k1=10, k2=20, step=0) is None
    assert duet_controller(cfg)["allocate"] is True
    # counts [3, 1]: nbar = 2, s_pre = [1, 0.5]; no stop flags, so every rollout is natural
    rollouts = _rollouts(["p"] * 3 + ["q"], [{}] * 4, [1.0, 0.0, 0.0, 1.0])
    batch, _ = shape_duet(rollouts, [3, 1], cfg, pad_id=0)
    assert rollouts.weights.tolist() == [1.0, 1.0, 1.0, 2.0]
    # group p: mean 1/3, sample std 1/sqrt(3); the singleton q gets A = r = 1 (verl)
    std = 1 / math.sqrt(3) + 1e-6
    expected = [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 1.0]
    assert rollouts.advantages == pytest.approx(expected, rel=1e-12)
    assert batch.advantages.tolist() == pytest.approx(
        [expected[0], expected[1], expected[2], 2.0], rel=1e-6
    )
    assert batch.response_mask.sum(dim=1).tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.duet.allocate=false", "algorithm.duet.early_stop=false"],
            r"algorithm\.duet\.allocate and algorithm\.duet\.early_stop are both false",
        ),
        (["algorithm.duet.allocate=false", "algorithm.duet.b=5"], r"algorithm\.duet: b=5"),
    ],
)
def test_bad_ablation_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*BASE, *overrides])
