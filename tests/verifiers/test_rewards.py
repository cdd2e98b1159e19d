"""Several rewards with weights (their sum, the first one's status, each one's reward) and the
example reward functions shipped in rlvr.verifiers.rewards, on hand values."""

import pytest

from rlvr.verifiers.factory import make_verifier
from rlvr.verifiers.rewards import boxed_format, format_reward, keyword_coverage
from rlvr.verifiers.weighted import combine, reward_name


def test_combine_is_the_weighted_sum_with_the_first_status():
    scored = [
        [(1.0, "correct"), (0.0, "wrong"), (0.0, "timeout")],
        [(1.0, "correct"), (1.0, "correct"), (0.5, "wrong")],
    ]
    assert combine([1.0, 0.5], scored) == [(1.5, "correct"), (0.5, "wrong"), (0.25, "timeout")]
    assert combine([-2.0], scored[:1]) == [(-2.0, "correct"), (0.0, "wrong"), (0.0, "timeout")]


def test_component_names():
    assert reward_name("math") == "math"
    assert reward_name("python", "rlvr.verifiers.rewards:boxed_format") == "boxed_format"
    assert reward_name("python", "pkg.mod:Rewards.fmt") == "fmt"
    assert reward_name("python", "pkg.mod:fmt", "format") == "format"


def test_math_plus_a_weighted_format_reward():
    rewards = [
        {"kind": "math", "weight": 1.0},
        {"kind": "python", "weight": 0.2, "function": "rlvr.verifiers.rewards:boxed_format"},
    ]
    with make_verifier(timeout=10.0, rewards=rewards) as v:
        v.wait_ready()
        out = v.verify_batch(
            ["So \\boxed{4}.", "\\boxed{5}", "The answer is 4", "nothing"], ["4", "4", "4", "4"]
        )
    assert out == [
        (pytest.approx(1.2), "correct", {"math": 1.0, "boxed_format": 1.0}),
        (pytest.approx(0.2), "wrong", {"math": 0.0, "boxed_format": 1.0}),
        (1.0, "correct", {"math": 1.0, "boxed_format": 0.0}),
        (0.0, "no_answer", {"math": 0.0, "boxed_format": 0.0}),
    ]


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("so $\\boxed{42}$.", 1.0),
        ("\\boxed{\\frac{1}{2}}\n", 1.0),
        ("\\boxed{\\sqrt{\\frac{1}{2}}}", 1.0),
        ("\\boxed{42} and then more words", 0.0),
        ("The answer is 42", 0.0),
        ("\\boxed{42", 0.0),
    ],
)
def test_boxed_format(response, reward):
    assert boxed_format([""], [response], ["42"], [{}]) == [reward]


def test_format_reward_with_a_pattern_of_ones_own():
    ends_with_answer = format_reward(r"Answer: \S+\s*\Z")
    assert ends_with_answer(
        ["", ""], ["x\nAnswer: 7", "Answer: 7 because"], ["7", "7"], [{}, {}]
    ) == [
        1.0,
        0.0,
    ]


def test_keyword_coverage():
    metadata = [
        {"keywords": ["Newton", "force"]},
        {"keywords": ["Newton", "force", "mass", "acceleration"]},
        {"keywords": "gravity"},
        {},
    ]
    responses = ["newton's second law: FORCE", "Newton said so", "no", "anything"]
    assert keyword_coverage([""] * 4, responses, [""] * 4, metadata) == [
        (1.0, "correct"),
        (0.25, "wrong"),
        (0.0, "wrong"),
        (0.0, "no_keywords"),
    ]
