"""Rollout statistics computed by hand."""

import pytest

from rlvr.run.metrics import group_stats, rollout_stats


def test_rollout_stats_by_hand():
    s = rollout_stats([1.0, 0.0, 1.0, 0.0], [10, 20, 30, 40], ["stop", "length", "stop", "stop"])
    assert s["rollouts"] == 4
    assert s["reward_mean"] == pytest.approx(0.5)
    assert s["accuracy"] == pytest.approx(0.5)
    assert s["length_mean"] == pytest.approx(25.0)
    assert s["length_p50"] == pytest.approx(25.0)
    assert s["length_p90"] == pytest.approx(37.0)  # linear interpolation: 30 + 0.7 * 10
    assert s["tokens_generated"] == 100
    assert s["truncated_frac"] == pytest.approx(0.25)


def test_empty_and_explicit_correct():
    assert rollout_stats([], [], []) == {"rollouts": 0}
    s = rollout_stats([0.3, 0.9], [1, 1], ["stop", "stop"], correct=[False, True])
    assert s["accuracy"] == pytest.approx(0.5)


def test_group_stats():
    s = group_stats([1, 1, 0, 1, 0, 0], ["a", "a", "b", "b", "c", "c"])
    assert s["groups"] == 3
    assert s["zero_signal_group_frac"] == pytest.approx(2 / 3)
    assert s["solved_group_frac"] == pytest.approx(1 / 3)
