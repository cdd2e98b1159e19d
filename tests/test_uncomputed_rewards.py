"""Rewards that were never computed (the verifier failed, or the environment did, not the model)
stay out of their group's statistics and train no tokens (`Rollouts.computed`)."""

from __future__ import annotations

import numpy as np
import pytest

from rlvr.algorithms.advantages import group_advantages
from rlvr.training.rollouts import UNCOMPUTED, Rollouts

# hand values are written to 3 decimals; eps=1e-6 in the divisor moves them by less than 1e-5
HAND = 1e-3


def rollouts(rewards: list[float], statuses: list[str], groups: list[str]) -> Rollouts:
    n = len(rewards)
    return Rollouts(
        groups, [[1]] * n, [[2, 3]] * n, ["x"] * n, ["1"] * n, ["stop"] * n, [{}] * n,
        rewards=np.asarray(rewards, dtype=np.float64), statuses=statuses,
    )  # fmt: skip


def test_a_crashed_environment_leaves_its_group_s_baseline():
    """[1, 1, 0, 0] with the last 0 a crash: the crash no longer pulls the baseline to 0.5, and
    the real 0 carries the whole negative signal."""
    r = rollouts([1, 1, 0, 0], ["correct", "correct", "wrong", "env_crashed"], ["a"] * 4)
    before = group_advantages(r.rewards, r.group_ids)
    assert before == pytest.approx([0.866, 0.866, -0.866, -0.866], abs=HAND)
    kept = r.computed()
    assert kept.statuses == ["correct", "correct", "wrong"]
    after = group_advantages(kept.rewards, kept.group_ids)
    assert after == pytest.approx([0.577, 0.577, -1.155], abs=HAND)


def test_a_group_left_with_fewer_than_two_computed_rewards_contributes_nothing():
    statuses = ["correct", "env_timeout", "callback_error", "verifier_failed"]
    statuses += ["wrong", "callback_timeout", "correct", "env_error"]
    r = rollouts([1, 0, 0, 0, 0, 0, 1, 0], statuses, ["a"] * 4 + ["b"] * 4)
    kept = r.computed()
    assert kept.group_ids == ["b", "b"] and kept.statuses == ["wrong", "correct"]
    # with singleton="reward" a lone survivor would have trained on A = r
    assert list(group_advantages(kept.rewards, kept.group_ids, singleton="reward")) == [
        pytest.approx(-0.707, abs=HAND),
        pytest.approx(0.707, abs=HAND),
    ]


def test_every_failure_of_an_environment_or_the_verifier_is_uncomputed():
    assert set(UNCOMPUTED) == {
        "verifier_failed",
        "env_error",
        "env_timeout",
        "env_bad_result",
        "env_crashed",
        "callback_error",
        "callback_timeout",
    }
    # a model that ran out of turns or tokens is the model's doing: scored as usual
    assert not {"done", "max_turns", "token_budget", "context_length"} & set(UNCOMPUTED)


def test_dapo_keeps_a_group_by_its_computed_rewards_and_refills_a_failed_one():
    """Round 0: prompt 0 has [correct, wrong, crash] (informative on its two real rewards: kept,
    two rows trained), prompt 1 [correct, crash, crash] (one real reward: dropped and refilled);
    the refill's prompt answers [correct, wrong, wrong]."""
    from pathlib import Path
    from types import SimpleNamespace

    from rlvr.config import load_config
    from rlvr.methods.dapo.method import Dapo
    from rlvr.tasks import Problem

    configs = Path(__file__).resolve().parents[1] / "configs"
    sets = ["algorithm.name=dapo", "generation.group_size=3", "generation.prompts_per_step=2"]
    cfg = load_config(configs / "tiny.yaml", sets)
    pool = [Problem(id=str(i), prompt="p", answer="1") for i in range(6)]
    ends = {"0": ["correct", "wrong", "env_crashed"], "1": ["correct", "env_crashed", "env_error"]}

    def generate(batch, n, params, step, first_index=0):
        ids = [p.id for p in batch for _ in range(3)]
        return rollouts([0.0] * len(ids), [], ids)

    def verify(part):
        part.statuses = [ends.get(g, ["correct", "wrong", "wrong"])[i % 3] for i, g in
                         enumerate(part.group_ids)]  # fmt: skip
        part.rewards = np.array([float(s == "correct") for s in part.statuses])

    run = SimpleNamespace(train_problems=pool, generate=generate, verify=verify)
    got = Dapo(cfg).collect(run, pool[:2], {}, None, 0, {})
    assert got.stats == {"dapo_rounds": 2, "dapo_kept_groups": 2, "dapo_dropped_groups": 1}
    assert len(got.rollouts) == 9 and not set(got.trained.statuses) & set(UNCOMPUTED)
    assert got.trained.group_ids[:2] == ["0", "0"] and len(got.trained) == 5
