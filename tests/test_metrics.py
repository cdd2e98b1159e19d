"""Rollout statistics computed by hand."""

import pytest

from rlvr.run.metrics import (
    UncomputedRewards,
    group_stats,
    reward_part_stats,
    rollout_stats,
    uncomputed_stats,
)


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


def test_uncomputed_rewards_are_counted_and_capped():
    statuses = ["correct", "verifier_failed", "timeout", "error", "wrong"]
    # a per-item timeout and an "error" are the verifier's verdicts; only its failure is uncomputed
    assert uncomputed_stats(statuses, 0.2, "step 3") == {
        "reward_uncomputed": 1,
        "reward_uncomputed_frac": 0.2,
        "reward_uncomputed_verifier_failed": 1,
    }
    assert uncomputed_stats([], 0.0, "step 3") == {
        "reward_uncomputed": 0,
        "reward_uncomputed_frac": 0.0,
    }
    with pytest.raises(
        UncomputedRewards, match=r"^step 3: 1 of 5 rewards uncomputed \(share 0\.2 > .*=0\.1\)"
    ):
        uncomputed_stats(statuses, 0.1, "step 3")
    with pytest.raises(UncomputedRewards, match=r"max_uncomputed_share=0\)"):
        uncomputed_stats(statuses, 0.0, "step 3")
    assert uncomputed_stats(["verifier_failed"], 1.0, "step 3")["reward_uncomputed_frac"] == 1.0


def test_a_failed_environment_counts_toward_the_uncomputed_share_by_status():
    statuses = ["correct", "env_crashed", "callback_timeout", "verifier_failed", "wrong"]
    statuses += ["env_crashed"]
    assert uncomputed_stats(statuses, 1.0, "step 3") == {
        "reward_uncomputed": 4,
        "reward_uncomputed_frac": pytest.approx(4 / 6),
        "reward_uncomputed_callback_timeout": 1,
        "reward_uncomputed_env_crashed": 2,
        "reward_uncomputed_verifier_failed": 1,
    }
    message = (
        r"^step 3: 4 of 6 rewards uncomputed \(share 0\.667 > verifier\.max_uncomputed_share=0\.5\)"
        r", by status: callback_timeout 1, env_crashed 2, verifier_failed 1; "
    )
    with pytest.raises(UncomputedRewards, match=message):
        uncomputed_stats(statuses, 0.5, "step 3")


def test_each_weighted_reward_is_averaged_over_the_rollouts_it_scored():
    parts = [{"math": 1.0, "format": 1.0}, {"math": 0.0, "format": 0.5}, {}]  # {}: uncomputed
    assert reward_part_stats(parts) == {
        "reward/math_mean": pytest.approx(0.5),
        "reward/format_mean": pytest.approx(0.75),
    }
    assert reward_part_stats([]) == {}


def test_agent_stats_per_trajectory_and_per_call():
    from rlvr.run.metrics import agent_stats

    flags = [
        {"turns": 3, "tool_calls": 2, "tool_errors": 1, "end_reason": "done", "repaired_chars": 3},
        {"turns": 1, "tool_calls": 0, "tool_errors": 0, "end_reason": "done", "repaired_chars": 0},
        {
            "turns": 4,
            "tool_calls": 6,
            "tool_errors": 0,
            "end_reason": "max_turns",
            "repaired_chars": 0,
        },
        {
            "turns": 2,
            "tool_calls": 0,
            "tool_errors": 0,
            "end_reason": "env_timeout",
            "repaired_chars": 2,
        },
    ]
    flags = [{"agent": record} for record in flags]
    assert agent_stats(flags) == {
        "agent_turns_mean": 2.5,
        "agent_tool_calls_per_trajectory": 2.0,
        "agent_tool_error_share": 1 / 8,
        "agent_repaired_chars_per_trajectory": 5 / 4,
        "agent_end_done": 0.5,
        "agent_end_env_timeout": 0.25,
        "agent_end_max_turns": 0.25,
    }
    assert agent_stats([{}, {"tandem": {}}]) == {}
