"""User dataset loading: GSM8K/MATH answer extraction, errors naming the file and row."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlvr.tasks.loaders import load_problems, split_answer


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_split_answer_gsm8k():
    raw = "She sold 48/2 = <<48/2=24>>24 clips.\nIn all 48 + 24 = <<48+24=72>>72.\n#### 1,072"
    gold, solution = split_answer(raw)
    assert gold == "1072"
    assert solution == (
        "She sold 48/2 = 24 clips.\nIn all 48 + 24 = 72.\nThe answer is \\boxed{1072}."
    )
    assert split_answer("#### 5") == ("5", "")


def test_split_answer_math_takes_the_last_box_with_nested_braces():
    raw = "First $\\boxed{3}$ is wrong; so $x = \\boxed{\\frac{1}{\\sqrt{2}}}$."
    assert split_answer(raw) == ("\\frac{1}{\\sqrt{2}}", raw)


def test_split_answer_plain():
    assert split_answer("  42 ") == ("42", "")


def test_jsonl_records(tmp_path):
    f = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"id": "g1", "prompt": "How many?", "answer": "3 + 4 = 7 apples.\n#### 7"},
            {"id": "m1", "prompt": "Find x.", "answer": "So $x = \\boxed{\\frac{1}{2}}$."},
            {"id": 7, "prompt": "Plain", "answer": 12},
            {"id": "s1", "prompt": "Q", "answer": "9", "solution": "4 + 5 = \\boxed{9}"},
            {"id": "r1", "prompt": "Q", "answer": "#### 2", "reference": "1 + 1 = 2"},
        ],
    )
    problems = load_problems(f)
    assert [p.id for p in problems] == ["g1", "m1", "7", "s1", "r1"]
    assert [p.answer for p in problems] == ["7", "\\frac{1}{2}", "12", "9", "2"]
    assert problems[0].solution == "3 + 4 = 7 apples.\nThe answer is \\boxed{7}."
    assert problems[2].solution == ""
    assert problems[3].solution == "4 + 5 = \\boxed{9}"
    assert problems[4].solution == "1 + 1 = 2"


def test_parquet(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(
        pa.table({"id": ["a", "b"], "prompt": ["q", "r"], "answer": ["#### 5", "\\boxed{6}"]}), f
    )
    assert [p.answer for p in load_problems(f)] == ["5", "6"]


def test_parquet_null_names_the_row(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["q", None], "answer": ["1", "2"]}), f)
    with pytest.raises(ValueError, match=r"d\.parquet: row 2: missing field\(s\) \['prompt'\]"):
        load_problems(f)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"id": "a", "prompt": "q", "answer": "1"}, "{not json"], r"row 2: invalid JSON"),
        ([{"id": "a", "prompt": "q"}], r"row 1: missing field\(s\) \['answer'\]"),
        ([{"id": "a", "prompt": "q", "answer": None}], r"row 1: missing field\(s\) \['answer'\]"),
        (['{"id": "a", "prompt": "q", "answer": NaN}'], r"row 1: missing field\(s\) \['answer'\]"),
        ([{"id": "a", "prompt": ["q"], "answer": "1"}], r"row 1: field 'prompt' must be str"),
        ([{"id": ["a"], "prompt": "q", "answer": "1"}], r"row 1: field 'id' must be str or int"),
        ([{"id": "a", "prompt": "q", "answer": True}], r"row 1: field 'answer' must be"),
        (
            [{"id": "a", "prompt": "q", "answer": "1", "solution": 3}],
            r"row 1: field 'solution' must be str",
        ),
        ([{"id": "a", "prompt": "  ", "answer": "1"}], r"row 1: field 'prompt' is empty"),
        ([{"id": "a", "prompt": "q", "answer": "#### "}], r"row 1: field 'answer' holds no"),
        (["[1, 2]"], r"row 1: expected an object"),
        (
            [
                {"id": "a", "prompt": "q", "answer": "1"},
                "",
                {"id": "a", "prompt": "r", "answer": "2"},
            ],
            r"row 3: duplicate id 'a' \(first at row 1\)",
        ),
    ],
)
def test_malformed_rows_are_named(tmp_path, rows, message):
    f = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=r"bad\.jsonl: " + message):
        load_problems(f)


def test_file_level_errors(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"e\.jsonl: the dataset is empty"):
        load_problems(tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match="not found"):
        load_problems(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("id,prompt,answer\n")
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_problems(tmp_path / "d.csv")
    (tmp_path / "latin.jsonl").write_bytes(b'{"id": "\xe9"}\n')
    with pytest.raises(ValueError, match="not UTF-8"):
        load_problems(tmp_path / "latin.jsonl")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"broken\.parquet: not a readable parquet file"):
        load_problems(tmp_path / "broken.parquet")
    pq.write_table(pa.table({"id": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="empty"):
        load_problems(tmp_path / "empty.parquet")
