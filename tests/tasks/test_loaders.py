"""User dataset loading: GSM8K/MATH answers, errors naming the row."""

import json

import pandas as pd
import pytest

from rlvr.tasks.loaders import load_problems, split_answer


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_gsm8k_and_math_answers(tmp_path):
    f = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"id": "g1", "prompt": "How many?", "answer": "3 + 4 = 7 apples.\n#### 1,007"},
            {"id": "m1", "prompt": "Find x.", "answer": "So $x = \\boxed{\\frac{1}{2}}$."},
            {"id": "p1", "prompt": "Plain", "answer": 12},
        ],
    )
    a, b, c = load_problems(f)
    assert (a.answer, b.answer, c.answer) == ("1007", "\\frac{1}{2}", "12")
    assert a.solution.startswith("3 + 4")
    assert split_answer("no box") == ("no box", "")


def test_parquet(tmp_path):
    f = tmp_path / "d.parquet"
    pd.DataFrame({"id": ["a"], "prompt": ["q"], "answer": ["#### 5"]}).to_parquet(f)
    assert load_problems(f)[0].answer == "5"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"id": "a", "prompt": "q", "answer": "1"}, "{not json"], r"row 2: invalid JSON"),
        ([{"id": "a", "prompt": "q"}], r"row 1: missing field\(s\) \['answer'\]"),
        ([{"id": "a", "prompt": ["q"], "answer": "1"}], r"row 1: field 'prompt' must be a string"),
        (
            [{"id": "a", "prompt": "q", "answer": "1"}, {"id": "a", "prompt": "r", "answer": "2"}],
            "duplicate id",
        ),
        (["[1, 2]"], r"row 1: expected an object"),
    ],
)
def test_malformed_rows_are_named(tmp_path, rows, message):
    f = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        load_problems(f)


def test_empty_and_missing(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_problems(tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match="not found"):
        load_problems(tmp_path / "nope.jsonl")
