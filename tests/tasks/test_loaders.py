"""User dataset loading: our layout and the published ones (GSM8K, MATH, MBPP, HumanEval), field
maps, chat-message prompts, shard and saved-dataset directories; errors naming file, row and field."""

import json
import logging
import pickle
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlvr.tasks.loaders import derived_id, load_problems, load_reference_problems, split_answer
from rlvr.tasks.prompts import prompt_messages, prompt_text
from rlvr.verifiers.code import CodeVerifier


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
        ([{"id": "a", "prompt": 5, "answer": "1"}], r"row 1: field 'prompt' must be str or list"),
        (
            [{"id": "a", "prompt": ["q"], "answer": "1"}],
            r"row 1: field 'prompt' message 1: expected an object with role and content",
        ),
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
    with pytest.raises(ValueError, match=r"d\.csv: unknown dataset format"):
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


# Published layouts: each fixture below is a few rows shaped as the public dataset ships them.


def test_gsm8k_layout_is_recognised_and_ids_derived(tmp_path, caplog):
    f = _write_jsonl(
        tmp_path / "gsm8k.jsonl",
        [
            {
                "question": "Tom has 3 apples and buys 4. How many?",
                "answer": "3+4=<<3+4=7>>7\n#### 7",
            },
            {"question": "Half of 10?", "answer": "10/2 = 5\n#### 5"},
        ],
    )
    with caplog.at_level(logging.INFO, logger="rlvr.tasks.loaders"):
        problems = load_problems(f)
    assert "gsm8k.jsonl: recognised the GSM8K layout" in caplog.text
    assert [p.prompt for p in problems] == ["Tom has 3 apples and buys 4. How many?", "Half of 10?"]
    assert [p.answer for p in problems] == ["7", "5"]
    assert problems[0].solution == "3+4=7\nThe answer is \\boxed{7}."
    # sha256 of the prompt's UTF-8 text, first 12 hex digits: the same on every run and machine
    assert problems[1].id == "81a79d6fa69d" == derived_id(problems[1])
    assert load_problems(f) == problems


def test_derived_ids_survive_reordering_and_number_repeated_prompts(tmp_path, caplog):
    rows = [
        {"question": "Half of 10?", "answer": "#### 5"},
        {"question": "Twice 4?", "answer": "#### 8"},
        {"question": "Half of 10?", "answer": "#### 5"},
    ]
    with caplog.at_level(logging.WARNING, logger="rlvr.tasks.loaders"):
        problems = load_problems(_write_jsonl(tmp_path / "a.jsonl", rows))
    assert [p.id for p in problems][::2] == ["81a79d6fa69d", "81a79d6fa69d-2"]
    assert "a.jsonl: row 3: the same prompt as row 1" in caplog.text
    reordered = load_problems(_write_jsonl(tmp_path / "b.jsonl", rows[1:2] + rows[:1]))
    assert {p.prompt: p.id for p in reordered} == {p.prompt: p.id for p in problems[:2]}


def test_math_layout(tmp_path, caplog):
    f = _write_jsonl(
        tmp_path / "math.jsonl",
        [
            {
                "problem": "Find $x$ if $2x = 1$.",
                "solution": "Divide: $x = \\boxed{\\frac{1}{2}}$.",
                "level": "Level 1",
                "type": "Algebra",
            }
        ],
    )
    with caplog.at_level(logging.INFO, logger="rlvr.tasks.loaders"):
        (p,) = load_problems(f)
    assert "recognised the MATH layout" in caplog.text
    assert (p.prompt, p.answer) == ("Find $x$ if $2x = 1$.", "\\frac{1}{2}")
    assert p.solution == "Divide: $x = \\boxed{\\frac{1}{2}}$."
    # MATH-500 adds the extracted answer and an id
    f = _write_jsonl(
        tmp_path / "math500.jsonl",
        [
            {
                "problem": "What is $1 + 2$?",
                "solution": "$1 + 2 = \\boxed{3}$",
                "answer": "3",
                "subject": "Prealgebra",
                "level": 1,
                "unique_id": "test/prealgebra/1.json",
            }
        ],
    )
    (p,) = load_problems(f)
    assert (p.id, p.answer, p.solution) == ("test/prealgebra/1.json", "3", "$1 + 2 = \\boxed{3}$")


@pytest.fixture(scope="module")
def code_verifier():
    with CodeVerifier(num_workers=1, timeout=10.0) as verifier:
        verifier.wait_ready()
        yield verifier


def _passes(verifier: CodeVerifier, code: str, answer: str) -> bool:
    """Whether `code` passes a code task's answer, judged by the code verifier in its sandbox
    (so the loader's format is checked against what reads it)."""
    reward, _ = verifier.verify(f"```python\n{code}\n```", answer)
    return reward == 1.0


MBPP_ROW = {
    "task_id": 2,
    "text": "Write a function to find the shared elements of two tuples.",
    "code": "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))",
    "test_list": [
        "assert similar_elements((3, 4, 5), (5, 7, 4)) == (4, 5)",
        "assert similar_elements((1, 2), (3, 4)) == ()",
    ],
    "test_setup_code": "",
    "challenge_test_list": [],
}
MBPP_SANITIZED_ROW = {
    "source_file": "Benchmark Questions Verification V2.ipynb",
    "task_id": 11,
    "prompt": "Write a python function to give the square root of a number, rounded.",
    "code": "def root(x):\n    return round(math.sqrt(x))",
    "test_imports": ["import math"],
    "test_list": ["assert root(16) == 4", "assert root(10) == 3"],
}
HUMANEVAL_ROW = {
    "task_id": "HumanEval/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n',
    "canonical_solution": "    return a + b\n",
    "test": "METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n",
    "entry_point": "add",
}


def test_mbpp_layout_tests_go_into_the_answer_and_the_prompt(tmp_path, caplog, code_verifier):
    f = _write_jsonl(tmp_path / "mbpp.jsonl", [MBPP_ROW])
    with caplog.at_level(logging.INFO, logger="rlvr.tasks.loaders"):
        (p,) = load_problems(f)
    assert "recognised the MBPP layout" in caplog.text
    assert p.id == "2"
    assert p.prompt == (
        "Write a function to find the shared elements of two tuples.\n"
        "Your code should pass these tests:\n" + "\n".join(MBPP_ROW["test_list"])
    )
    assert json.loads(p.answer) == {"asserts": MBPP_ROW["test_list"]}
    assert _passes(code_verifier, MBPP_ROW["code"], p.answer)
    assert not _passes(code_verifier, "def similar_elements(a, b):\n    return ()", p.answer)

    (p,) = load_problems(_write_jsonl(tmp_path / "sanitized.jsonl", [MBPP_SANITIZED_ROW]))
    assert p.id == "11"
    assert json.loads(p.answer) == {
        "asserts": MBPP_SANITIZED_ROW["test_list"],
        "setup": "import math",
    }
    assert _passes(code_verifier, MBPP_SANITIZED_ROW["code"], p.answer)


def test_humaneval_layout(tmp_path, caplog, code_verifier):
    f = _write_jsonl(tmp_path / "humaneval.jsonl", [HUMANEVAL_ROW])
    with caplog.at_level(logging.INFO, logger="rlvr.tasks.loaders"):
        (p,) = load_problems(f)
    assert "recognised the HumanEval layout" in caplog.text
    assert (p.id, p.prompt) == ("HumanEval/0", HUMANEVAL_ROW["prompt"])
    (source,) = json.loads(p.answer)["asserts"]
    assert source == HUMANEVAL_ROW["test"] + "\ncheck(add)\n"
    assert _passes(
        code_verifier, HUMANEVAL_ROW["prompt"] + HUMANEVAL_ROW["canonical_solution"], p.answer
    )
    assert not _passes(code_verifier, HUMANEVAL_ROW["prompt"] + "    return a - b\n", p.answer)


CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
]


def test_chat_messages_prompt_is_kept_as_turns(tmp_path):
    f = _write_jsonl(tmp_path / "chat.jsonl", [{"id": "c1", "prompt": CHAT, "answer": "5"}])
    (p,) = load_problems(f)
    assert p.messages == (("system", "You are terse."), ("user", "What is 2 + 3?"))
    assert p.prompt == "What is 2 + 3?"
    assert prompt_messages(p, "Box it.") == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 3? Box it."},
    ]
    with pytest.raises(ValueError, match=r"problem 'c1': its prompt is a list of chat messages"):
        prompt_text(p)
    with pytest.raises(
        ValueError,
        match=r"chat\.jsonl: row 1: field 'prompt' is a list of chat messages, which "
        r"task\.chat_template=false cannot render",
    ):
        load_problems(f, chat_template=False)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], r"field 'prompt' is an empty list of messages"),
        ([{"role": "user", "content": "q"}, "hi"], r"field 'prompt' message 2: expected an object"),
        ([{"role": "bot", "content": "q"}], r"field 'prompt' message 1: role must be one of"),
        ([{"role": "user", "content": 3}], r"field 'prompt' message 1: content must be str"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            r"field 'prompt': the last message must be the user's turn",
        ),
    ],
)
def test_bad_chat_messages_are_named(tmp_path, prompt, message):
    f = _write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"id": "ok", "prompt": CHAT, "answer": "5"},
            {"id": "c2", "prompt": prompt, "answer": "5"},
        ],
    )
    with pytest.raises(ValueError, match=r"chat\.jsonl: row 2: " + message):
        load_problems(f)


def test_field_map(tmp_path, caplog):
    f = _write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"key": "k1", "q": "2 + 2?", "gold": 4, "work": "2 + 2 = \\boxed{4}", "answer": "x"},
            {"key": "k2", "q": [{"role": "user", "content": "3 + 3?"}], "gold": "#### 6"},
        ],
    )
    fields = {"id": "key", "prompt": "q", "answer": "gold", "solution": "work"}
    with caplog.at_level(logging.INFO, logger="rlvr.tasks.loaders"):
        problems = load_problems(f, fields)
    assert (
        "mine.jsonl: columns by task.fields: id <- key, prompt <- q, answer <- gold" in caplog.text
    )
    assert [(p.id, p.prompt, p.answer) for p in problems] == [
        ("k1", "2 + 2?", "4"),
        ("k2", "3 + 3?", "6"),
    ]
    assert problems[0].solution == "2 + 2 = \\boxed{4}"
    assert problems[1].messages == (("user", "3 + 3?"),)
    # a code task's tests through the map; no id column: derived
    f = _write_jsonl(
        tmp_path / "code.jsonl", [{"desc": "Write f, doubling.", "checks": ["assert f(2) == 4"]}]
    )
    (p,) = load_problems(f, {"prompt": "desc", "tests": "checks"})
    assert p.prompt == "Write f, doubling."
    assert json.loads(p.answer) == {"asserts": ["assert f(2) == 4"]}
    assert p.id == derived_id(p)


def test_field_map_missing_field_names_file_row_and_field(tmp_path):
    f = _write_jsonl(
        tmp_path / "mine.jsonl",
        [{"key": "k1", "q": "2 + 2?", "gold": "4"}, {"key": "k2", "q": "3 + 3?"}],
    )
    with pytest.raises(ValueError, match=r"mine\.jsonl: row 2: missing field\(s\) \['gold'\]"):
        load_problems(f, {"id": "key", "prompt": "q", "answer": "gold"})
    with pytest.raises(ValueError, match=r"mine\.jsonl: row 1: missing field\(s\) \['question'\]"):
        load_problems(f, {"prompt": "question", "answer": "gold"})
    with pytest.raises(ValueError, match=r"task\.fields: unknown field\(s\) \['question'\]"):
        load_problems(f, {"question": "q"})


def test_ambiguous_and_unknown_layouts_ask_for_a_field_map(tmp_path):
    f = _write_jsonl(tmp_path / "both.jsonl", [{"prompt": "q", "question": "q", "answer": "1"}])
    with pytest.raises(
        ValueError,
        match=r"both\.jsonl: row 1: the columns \['answer', 'prompt', 'question'\] fit several "
        r"layouts \(id/prompt/answer \(ours\); GSM8K.*\): name the fields with task\.fields",
    ):
        load_problems(f)
    f = _write_jsonl(tmp_path / "other.jsonl", [{"input": "q", "target": "1"}])
    with pytest.raises(
        ValueError,
        match=r"other\.jsonl: row 1: the columns \['input', 'target'\] fit no known layout.*"
        r"task\.fields\.prompt=<column>",
    ):
        load_problems(f)
    assert load_problems(f, {"prompt": "input", "answer": "target"})[0].answer == "1"


def test_bad_row_type_names_file_and_row(tmp_path):
    f = _write_jsonl(
        tmp_path / "gsm8k.jsonl", [{"question": "q", "answer": "#### 1"}, "", '["q", "#### 2"]']
    )
    with pytest.raises(
        ValueError,
        match=r"gsm8k\.jsonl: row 3: expected an object with fields \['question', 'answer'\], got list",
    ):
        load_problems(f)
    f = _write_jsonl(
        tmp_path / "mbpp.jsonl", [{**MBPP_ROW, "test_list": "nope"}, {**MBPP_ROW, "test_list": [1]}]
    )
    with pytest.raises(
        ValueError, match=r"mbpp\.jsonl: row 2: field 'test_list' must be a list of str"
    ):
        load_problems(f)


def _shard(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_parquet_directory_reads_every_shard_in_sorted_order(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    _shard(d / "train-00001-of-00002.parquet", [{"question": "c?", "answer": "#### 3"}])
    _shard(
        d / "train-00000-of-00002.parquet",
        [{"question": "a?", "answer": "#### 1"}, {"question": "b?", "answer": "#### 2"}],
    )
    (d / "README.md").write_text("not data")
    assert [p.answer for p in load_problems(d)] == ["1", "2", "3"]
    _shard(
        d / "train-00001-of-00002.parquet",
        [{"question": "c?", "answer": "#### 3"}, {"question": None, "answer": "#### 4"}],
    )
    with pytest.raises(
        ValueError, match=r"train-00001-of-00002\.parquet: row 2: missing field\(s\) \['question'\]"
    ):
        load_problems(d)


def test_duplicate_ids_across_shards_name_both(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    _shard(d / "part-0.parquet", [{"id": "x", "prompt": "a", "answer": "1"}])
    _shard(
        d / "part-1.parquet",
        [{"id": "y", "prompt": "b", "answer": "2"}, {"id": "x", "prompt": "c", "answer": "3"}],
    )
    with pytest.raises(
        ValueError,
        match=r"part-1\.parquet: row 2: duplicate id 'x' \(first at .*part-0\.parquet: row 1\)",
    ):
        load_problems(d)


def test_hub_directory_with_several_splits_takes_a_pattern(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    _shard(d / "train-00000-of-00001.parquet", [{"question": "a?", "answer": "#### 1"}])
    _shard(d / "test-00000-of-00001.parquet", [{"question": "b?", "answer": "#### 2"}])
    with pytest.raises(ValueError, match=r"several splits \['test', 'train'\]: give one"):
        load_problems(d)
    assert [p.answer for p in load_problems(d / "train-*.parquet")] == ["1"]
    with pytest.raises(ValueError, match=r"valid-\*\.parquet: no dataset file matches"):
        load_problems(d / "valid-*.parquet")
    with pytest.raises(ValueError, match=r"empty: the directory holds no dataset files"):
        (tmp_path / "empty").mkdir()
        load_problems(tmp_path / "empty")


def _arrow_stream(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _saved_dataset(path, shards):
    """A directory laid out as `datasets.Dataset.save_to_disk` writes one."""
    path.mkdir()
    names = []
    for i, rows in enumerate(shards):
        names.append(f"data-{i:05d}-of-{len(shards):05d}.arrow")
        _arrow_stream(path / names[-1], rows)
    (path / "dataset_info.json").write_text("{}")
    state = {"_data_files": [{"filename": n} for n in names], "_split": "train"}
    (path / "state.json").write_text(json.dumps(state))
    return path


def test_saved_dataset_without_the_datasets_package(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    d = _saved_dataset(
        tmp_path / "saved",
        [
            [{"problem": "p1", "solution": "\\boxed{1}"}],
            [{"problem": "p2", "solution": "\\boxed{2}"}],
        ],
    )
    with caplog.at_level(logging.INFO, logger="rlvr.tasks.loaders"):
        problems = load_problems(d)
    assert [p.answer for p in problems] == ["1", "2"]
    assert "read from its arrow shards (datasets is not installed)" in caplog.text
    # an arrow file on its own, in either IPC format
    assert load_problems(d / "data-00001-of-00002.arrow")[0].answer == "2"
    table = pa.Table.from_pylist([{"id": "f", "prompt": "q", "answer": "7"}])
    with (
        pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    assert load_problems(tmp_path / "file.arrow")[0].answer == "7"
    (tmp_path / "bad.arrow").write_bytes(b"nope")
    with pytest.raises(ValueError, match=r"bad\.arrow: not a readable arrow file"):
        load_problems(tmp_path / "bad.arrow")


def test_saved_dataset_through_datasets_when_installed(tmp_path, monkeypatch):
    class Dataset:
        def __init__(self, rows):
            self.rows = rows

        def to_list(self):
            return self.rows

    loaded = {}

    def load_from_disk(path):
        loaded["path"] = path
        if path.endswith("dict"):
            return {"train": Dataset([]), "test": Dataset([])}
        return Dataset([{"question": "q", "answer": "#### 9"}])

    fake = types.SimpleNamespace(Dataset=Dataset, load_from_disk=load_from_disk)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    d = _saved_dataset(tmp_path / "saved", [[{"ignored": 1}]])
    assert [p.answer for p in load_problems(d)] == ["9"]
    assert loaded["path"] == str(d)
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "state.json").write_text("{}")
    with pytest.raises(
        ValueError, match=r"dict: a dataset with several splits \['test', 'train'\]"
    ):
        load_problems(tmp_path / "dict")


def test_dataset_dict_directory_names_its_splits(tmp_path):
    d = tmp_path / "gsm8k"
    d.mkdir()
    (d / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    for split in ("train", "test"):
        _saved_dataset(d / split, [[{"question": "q", "answer": "#### 1"}]])
    with pytest.raises(
        ValueError, match=r"gsm8k: a dataset with several splits \['test', 'train'\]"
    ):
        load_problems(d)
    assert load_problems(d / "test")[0].answer == "1"


def test_reference_file_takes_a_field_map_and_derives_ids(tmp_path):
    f = _write_jsonl(tmp_path / "ref.jsonl", [{"q": "Explain 1 + 1.", "ref": " 2"}])
    (p,) = load_reference_problems(f, {"prompt": "q", "reference": "ref"})
    assert (p.prompt, p.reference, p.answer) == ("Explain 1 + 1.", " 2", "")
    assert p.id == derived_id(p)
    with pytest.raises(ValueError, match=r"ref\.jsonl: row 1: missing field\(s\) \['reference'\]"):
        load_reference_problems(f, {"prompt": "q"})


def test_solution_wins_over_its_reference_alias(tmp_path):
    row = {"id": "a", "prompt": "q", "answer": "1", "solution": "s \\boxed{1}", "reference": "r"}
    (p,) = load_problems(_write_jsonl(tmp_path / "d.jsonl", [row]))
    assert p.solution == "s \\boxed{1}"


def test_gzipped_json_lines_and_json_documents(tmp_path):
    import gzip

    f = tmp_path / "HumanEval.jsonl.gz"
    f.write_bytes(gzip.compress((json.dumps(HUMANEVAL_ROW) + "\n").encode()))
    assert load_problems(f)[0].id == "HumanEval/0"
    rows = [{"question": "a?", "answer": "#### 1"}, {"question": "b?", "answer": "#### 2"}]
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=2))
    assert [p.answer for p in load_problems(tmp_path / "array.json")] == ["1", "2"]
    (tmp_path / "one.json").write_text(json.dumps(rows[0], indent=2))
    assert [p.answer for p in load_problems(tmp_path / "one.json")] == ["1"]
    (tmp_path / "bad.json").write_text(json.dumps([rows[0], {"question": "c?"}], indent=2))
    with pytest.raises(ValueError, match=r"bad\.json: row 2: missing field\(s\) \['answer'\]"):
        load_problems(tmp_path / "bad.json")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz: not a readable gzip file"):
        load_problems(tmp_path / "bad.jsonl.gz")


def test_extra_columns_and_a_metadata_object_become_the_problems_metadata(tmp_path):
    f = _write_jsonl(
        tmp_path / "meta.jsonl",
        [
            {"id": "a", "prompt": "Q", "answer": "1", "level": 3, "metadata": {"keywords": ["x"]}},
            {"id": "b", "prompt": "Q", "answer": "2", "metadata": {"level": 5}, "level": 4},
            {"id": "c", "prompt": "Q", "answer": "3", "level": None},
        ],
    )
    problems = load_problems(f)
    assert [dict(p.metadata) for p in problems] == [
        {"level": 3, "keywords": ["x"]},
        {"level": 5},  # the metadata object wins over a column of the same name
        {},
    ]
    # columns a field map reads are not metadata; the rest are
    (p,) = load_problems(
        _write_jsonl(tmp_path / "m.jsonl", [{"q": "Q", "gold": "1", "answer": "x", "topic": "t"}]),
        {"prompt": "q", "answer": "gold"},
    )
    assert p.metadata == (("answer", "x"), ("topic", "t"))
    with pytest.raises(ValueError, match=r"row 1: field 'metadata' must be an object, got str"):
        load_problems(
            _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Q", "answer": "1", "metadata": "x"}])
        )
    assert pickle.loads(pickle.dumps(problems[0])) == problems[0]
