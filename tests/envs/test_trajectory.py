"""The trajectory record: its sequence, masks and log-probs line up turn by turn, it ends with a
known reason, and it crosses processes as plain data."""

from __future__ import annotations

import json

import pytest

from rlvr.envs.trajectory import END_REASONS, Trajectory, Turn

PROMPT = [{"role": "user", "content": "Q"}]
TOOL = [{"role": "tool", "name": "calculate", "content": "4"}]


def two_turns() -> Trajectory:
    trajectory = Trajectory(PROMPT, [1, 2, 3])
    trajectory.turns.append(Turn([10, 11], [-0.1, -0.2], "call", "stop", TOOL, [20, 21, 22]))
    trajectory.turns.append(Turn([12], [-0.3], "4", "stop", reward=1.0, info={"k": 1}))
    return trajectory


def test_sequence_mask_and_logprobs_line_up():
    trajectory = two_turns()
    assert trajectory.token_ids() == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert trajectory.loss_mask() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert trajectory.token_logprobs() == [0, 0, 0, -0.1, -0.2, 0, 0, 0, -0.3]
    assert trajectory.model_tokens() == 3


def test_the_conversation_the_reward_and_the_answer():
    trajectory = two_turns()
    assert trajectory.messages() == [
        *PROMPT,
        {"role": "assistant", "content": "call"},
        *TOOL,
        {"role": "assistant", "content": "4"},
    ]
    assert trajectory.env_reward() == 1.0
    assert trajectory.final_text() == "4"
    assert Trajectory(PROMPT, [1]).env_reward() is None


def test_it_ends_with_a_known_reason():
    trajectory = two_turns()
    trajectory.end("max_turns")
    assert trajectory.end_reason == "max_turns"
    assert {"done", "token_budget", "context_limit", "env_timeout"} <= set(END_REASONS)
    with pytest.raises(ValueError, match="end reason 'bored' is not one of"):
        trajectory.end("bored")


def test_a_turn_needs_a_logprob_per_id():
    with pytest.raises(ValueError, match="2 completion ids but 1 log-probs"):
        Turn([1, 2], [-0.1], "x", "stop")


def test_it_round_trips_as_json():
    trajectory = two_turns()
    trajectory.end("done")
    data = json.loads(json.dumps(trajectory.to_data()))
    assert Trajectory.from_data(data) == trajectory
