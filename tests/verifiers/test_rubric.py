"""DRO rubric pipeline (arXiv:2506.13351, Sec. 4.1 and App. E): writing, validation against the
reference, regeneration, ungated queries, judging with one retry, the keyword judge and the rubric
cache."""

import json

from rlvr.generation import make_backend
from rlvr.models.tiny import build_tiny_model
from rlvr.verifiers.rubric import (
    JudgeRequest,
    KeywordRubricModel,
    ReferenceRubricModel,
    RubricQuery,
    RubricSet,
    build_rubrics,
    judge_answers,
    load_rubrics,
    rubric_json,
    save_rubrics,
)


class ScriptedModel:
    """Replies from fixed scripts: `writes[attempt][query index]`, and a judge that says yes to
    items not listed in `fails` and answers garbage on its first `garbage` attempts."""

    def __init__(self, writes, fails=(), garbage=0):
        self.writes, self.fails, self.garbage = writes, set(fails), garbage
        self.judged: list[tuple[int, int]] = []

    def write(self, queries, attempt):
        return [self.writes[attempt][i] for i in range(len(queries))]

    def judge(self, requests, attempt):
        self.judged.append((attempt, len(requests)))
        if attempt < self.garbage:
            return ["I think they are mostly fine."] * len(requests)
        return [
            json.dumps(
                [{"id": k, "satisfied": item not in self.fails} for k, item in enumerate(r.rubrics)]
            )
            for r in requests
        ]


def items_reply(items):
    return "Here are the rubrics:\n" + rubric_json(items)


Q = RubricQuery("Compute 3 + 4. Put your final answer in \\boxed{}.", "\\boxed{7}.")


def test_twelve_items_are_cut_to_ten_and_failing_items_dropped():
    items = [f"item {k}" for k in range(12)]
    model = ScriptedModel([[items_reply(items)]], fails={"item 2"})
    (rubrics,) = build_rubrics(model, [Q])
    assert rubrics.items == tuple(f"item {k}" for k in range(10) if k != 2)
    assert (rubrics.ungated, rubrics.attempts, rubrics.dropped) == (False, 1, 1)


def test_regenerates_until_an_item_survives_then_ungated():
    bad = items_reply(["wrong"])
    good = items_reply(["right"])
    model = ScriptedModel([[bad, bad], ["no json at all", bad], [good, bad]], fails={"wrong"})
    first, second = build_rubrics(model, [Q, Q])
    assert first == RubricSet(("right",), False, 3, 1)
    assert second == RubricSet((), True, 3, 3)
    # each round only rewrites what is still pending
    assert [n for _, n in model.judged] == [2, 1, 2]


def test_judge_retries_unparseable_replies_once_then_says_no():
    req = JudgeRequest("q", "answer", ("a", "b"))
    once = ScriptedModel([], garbage=1)
    rows, failed = judge_answers(once, [req, JudgeRequest("q", "x", ())])
    assert [r.tolist() for r in rows] == [[True, True], []] and failed == 0
    assert once.judged == [(0, 1), (1, 1)]  # the ungated request never reaches the judge
    twice = ScriptedModel([], garbage=2)
    rows, failed = judge_answers(twice, [req])
    assert rows[0].tolist() == [False, False] and failed == 1


def test_keyword_model_writes_value_items_and_judges_whole_words():
    model = KeywordRubricModel()
    ref = " Ana has 5 more marbles than Tom."
    (rubrics,) = build_rubrics(model, [RubricQuery("q", ref)])
    assert rubrics.items == (
        'The response contains "Ana".',
        'The response contains "5".',
        'The response contains "Tom".',
    )
    answers = ["Tom has 5 more marbles than Ana.", "Ana has 15 more than Tom.", "Ana: 5.5, Tom"]
    rows, failed = judge_answers(model, [JudgeRequest("q", a, rubrics.items) for a in answers])
    assert failed == 0
    assert [r.tolist() for r in rows] == [
        [True, True, True],
        [True, False, True],
        [True, False, True],
    ]
    # an item outside the keyword language is "No"
    (row,), _ = judge_answers(model, [JudgeRequest("q", "anything", ("Is it polite?",))])
    assert row.tolist() == [False]
    # "The" only starts the sentence; a reference without values or names is ungated
    (sentence,) = build_rubrics(model, [RubricQuery("q", "The brother will be 16 years old.")])
    assert sentence.items == ('The response contains "16".',)
    (negative,) = build_rubrics(model, [RubricQuery("q", " \\boxed{-3}.")])
    assert negative.items == ('The response contains "-3".',)
    rows, _ = judge_answers(model, [JudgeRequest("q", a, negative.items) for a in ("-3", "3")])
    assert [r.tolist() for r in rows] == [[True], [False]]
    (none,) = build_rubrics(model, [RubricQuery("q", "yes")])
    assert none.ungated and none.items == ()


def test_boxed_arithmetic_reference():
    model = KeywordRubricModel()
    (rubrics,) = build_rubrics(model, [Q])
    assert rubrics.items == ('The response contains "7".',)
    rows, _ = judge_answers(
        model,
        [JudgeRequest("q", a, rubrics.items) for a in (" \\boxed{7}.", " \\boxed{17}.", "-7")],
    )
    assert [r.tolist() for r in rows] == [[True], [False], [False]]


def test_cache_round_trip(tmp_path):
    path = tmp_path / "sub" / "rubrics.json"
    assert load_rubrics(path) == {}
    sets = {"a": RubricSet(("x", "y"), False, 1, 0), "b": RubricSet((), True, 3, 2)}
    save_rubrics(path, sets)
    assert load_rubrics(path) == sets


def test_reference_model_path_on_the_tiny_model(tmp_path):
    """The language-model author/judge runs end to end; the untrained tiny model writes no JSON,
    so every query ends ungated and every judgment counts as a failure."""
    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    backend = make_backend("hf", model_dir, dtype="float32")
    model = ReferenceRubricModel(backend, backend.tokenizer, max_model_len=1024, max_tokens=6)
    (rubrics,) = build_rubrics(model, [Q])
    assert rubrics.ungated
    rows, failed = judge_answers(model, [JudgeRequest(Q.query, "\\boxed{7}", ("states 7",))])
    assert rows[0].tolist() == [False] and failed == 1
    # a prompt that does not fit the context gets an empty reply instead of an engine error
    short = ReferenceRubricModel(backend, backend.tokenizer, max_model_len=64, max_tokens=6)
    assert short.judge([JudgeRequest("q", "a", ("b",))], 0) == [""]
