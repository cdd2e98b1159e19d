"""Final-answer extraction: boxed answers by brace matching, answer-line fallbacks, big inputs."""

import pytest

from rlvr.answers import extract_answer, final_answer_line, last_boxed


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"so $\boxed{\frac{1}{2}}$ and done", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{a^{2}+b^{2}}}{2}}", r"\frac{\sqrt{a^{2}+b^{2}}}{2}"),
        (r"first \boxed{1}, on reflection \boxed{2}", "2"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the group
        (r"\boxed{a \\ b}", r"a \\ b"),
        (r"\boxed {x^{2}}", "x^{2}"),
        (r"$\boxed 5$.", "5"),
        (r"\boxed 12.", "12"),
        (r"\fbox{7}", "7"),
        (r"\boxed{3} then \fbox{4}", "4"),
    ],
)
def test_last_boxed_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize(
    "response",
    [
        r"\boxed{3} but then \boxed{4",  # the last box is truncated: no earlier fallback
        r"\boxed{}",
        r"\boxed{   }",
        "no answer anywhere",
        "",
    ],
)
def test_no_answer(response):
    assert extract_answer(response) is None


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("#### 1,000", "1,000"),
        ("The answer is $42$.", "42"),
        ("So the answer is 3.14. Because the circle...", "3.14"),
        ("Final answer: 17", "17"),
        ("**Final Answer:** \\(x = 2\\)", "x = 2"),
        ("Answer: 5\nLater: the answer is 6", "6"),
        (r"\fboxsep is set; answer: 9", "9"),  # \fboxsep is another macro, not a box
    ],
)
def test_answer_line_fallback(response, answer):
    assert extract_answer(response) == answer


def test_boxed_answer_wins_over_answer_lines():
    assert extract_answer("The answer is 5.\n\\boxed{6}\n#### 7") == "6"
    assert final_answer_line("The answer is 5.\n\\boxed{6}\n#### 7") == "7"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("\\fboxsep" * 125_000, None),  # another macro, never a box
        ("{" * 1_000_000, None),
        ("\\boxed{" + "{" * 1_000_000, None),  # a box that never closes
        ("answer: " * 125_000, ("answer: " * 124_999).strip()),  # the first answer line's rest
        ("#" * 1_000_000, "#" * 999_996),  # after the first "####"
    ],
)
def test_megabyte_inputs_are_linear(text, answer):
    """Each input would be quadratic under a naive rfind loop or a backtracking regex: a 1 MB
    scan then takes hours, a linear one under a second (0.3 s at most on a 2-core machine), so
    30 s fails only a quadratic scan."""
    assert extract_answer(text) == answer


def test_megabyte_boxed_answer_is_extracted_whole():
    body = "1+" * 500_000 + "1"
    assert last_boxed("\\boxed{" + body + "}") == body
