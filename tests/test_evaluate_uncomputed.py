"""`rlvr evaluate` leaves a trajectory that failed on the environment's side out of its scores,
as training does (`rlvr.training.rollouts.UNCOMPUTED`): it is not verified, counts in neither
accuracy nor pass@k, a problem all of whose samples failed is left out, and the summary counts
them by status."""

import pytest

from rlvr.envs.rollout import AGENT_FLAGS
from rlvr.generation.base import GenerationResult, Sample
from rlvr.tasks.base import Problem
from workflows.evaluate import collect, plot, score


def sample(text: str, end_reason: str | None = None) -> Sample:
    flags = {} if end_reason is None else {AGENT_FLAGS: {"end_reason": end_reason}}
    return Sample([1, 2, 3], text, [0.0] * 3, "stop", flags)


PROBLEMS = [Problem(id=str(i), prompt=f"p{i}", answer="4") for i in range(3)]


def test_a_failed_trajectory_is_not_verified_and_keeps_its_end_reason():
    results = [
        GenerationResult("0", [0], [sample("\\boxed{4}", "env_timeout"), sample("\\boxed{4}")])
    ]
    verdicts = score(results, PROBLEMS[:1], 2, None, 5.0)
    assert [v[:2] for v in verdicts] == [(0.0, "env_timeout"), (1.0, "correct")]


def test_uncomputed_samples_are_left_out_of_accuracy_and_pass_at_k():
    # problem 0: one right, one wrong, one environment failure; problem 1: all three right;
    # problem 2: every trajectory failed on the environment's side
    results = [
        GenerationResult("0", [0], [sample("a"), sample("b"), sample("c", "env_error")]),
        GenerationResult("1", [0], [sample("a"), sample("b"), sample("c")]),
        GenerationResult("2", [0], [sample("a", "env_crashed"), sample("b", "callback_timeout")]),
    ]
    verdicts = [
        (1.0, "correct"),
        (0.0, "wrong"),
        (0.0, "env_error"),
        (1.0, "correct"),
        (1.0, "correct"),
        (1.0, "correct"),
        (0.0, "env_crashed"),
        (0.0, "callback_timeout"),
    ]
    summary, items = collect(PROBLEMS, results, verdicts)
    assert summary["accuracy"] == pytest.approx((1 / 2 + 1) / 2)
    # pass@1 is the accuracy; pass@2 of problem 0 is 1 (one of its two scored samples is right)
    assert summary["pass_at_k"] == {"1": pytest.approx(0.75), "2": 1.0}
    assert (summary["problems"], summary["problems_scored"]) == (3, 2)
    assert summary["uncomputed"] == 3
    assert summary["uncomputed_by_status"] == {
        "env_error": 1,
        "env_crashed": 1,
        "callback_timeout": 1,
    }
    assert items[0]["correct"] == [True, False, None]
    assert items[2]["correct"] == [None, None]


def test_pass_at_k_needs_k_scored_samples():
    """A problem with fewer scored samples than k has no unbiased pass@k: it is left out of that
    k only."""
    results = [
        GenerationResult("0", [0], [sample("a"), sample("b")]),
        GenerationResult("1", [0], [sample("a"), sample("b", "env_error")]),
    ]
    verdicts = [(0.0, "wrong"), (1.0, "correct"), (1.0, "correct"), (0.0, "env_error")]
    summary, _ = collect(PROBLEMS[:2], results, verdicts)
    assert summary["pass_at_k"] == {"1": pytest.approx(0.75), "2": 1.0}
    assert summary["uncomputed"] == 1 and summary["problems_scored"] == 2


def test_nothing_uncomputed_reads_as_before():
    results = [GenerationResult("0", [0], [sample("a"), sample("b")])]
    summary, _ = collect(PROBLEMS[:1], results, [(1.0, "correct"), (0.0, "wrong")])
    assert summary["accuracy"] == 0.5 and summary["pass_at_k"] == {"1": 0.5, "2": 1.0}
    assert summary["uncomputed"] == 0 and summary["uncomputed_by_status"] == {}


def test_an_evaluation_with_nothing_scored_has_no_accuracy_and_still_plots(tmp_path):
    results = [GenerationResult("0", [0], [sample("a", "env_timeout")])]
    verdicts = score(results, PROBLEMS[:1], 1, None, 5.0)
    summary, items = collect(PROBLEMS[:1], results, verdicts)
    assert summary["accuracy"] is None and summary["pass_at_k"] == {"1": None}
    assert summary["uncomputed_by_status"] == {"env_timeout": 1}
    assert plot(summary, items, tmp_path).is_file()
