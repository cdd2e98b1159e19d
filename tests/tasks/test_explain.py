"""The explain-then-answer task and the reference-answer loader (DRO data without a verifier)."""

import json

import pytest

from rlvr.config import TaskConfig
from rlvr.methods.dro.rollouts import reference_text
from rlvr.tasks import load_task
from rlvr.tasks.explain import ANSWER_DELIMITER, ExplainTask
from rlvr.tasks.loaders import load_problems, load_reference_problems


def test_seeded_disjoint_and_well_formed():
    task = ExplainTask(seed=3, n_test=20)
    train, test = task.problems("train", 200), task.problems("test", 20)
    assert train == ExplainTask(seed=3, n_test=20).problems("train", 200)
    assert train != ExplainTask(seed=4, n_test=20).problems("train", 200)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert len({p.id for p in train}) == 200
    for p in train + test:
        assert p.prompt.endswith("Explain, then answer.")
        assert p.solution.endswith(f"{ANSWER_DELIMITER}{p.reference}")
        assert reference_text(p, ANSWER_DELIMITER) == p.reference
        assert p.reference.startswith(" ") and p.answer in p.reference
    markers = ("how many more?", "How many coins", "How old will", "Sort these")
    assert all(any(m in p.prompt for p in train) for m in markers)  # every template is drawn


def test_templates_by_hand():
    def first(template):
        (p,) = ExplainTask(seed=0, n_test=1, templates=(template,)).problems("test", 1)
        return p

    p = first("compare")
    assert p.prompt.startswith("Sam has 20 stickers and Mia has 19 stickers.")
    assert (p.answer, p.reference) == ("1", " Sam has 1 more stickers than Mia.")
    assert p.solution == (
        "Sam has 20 and Mia has 19.\n20 - 19 = 1, so Sam has more.\n"
        "Answer: Sam has 1 more stickers than Mia."
    )
    p = first("total")  # 3 balls at 9 coins and one kite at 9: 3 * 9 + 9
    assert "Ivy buys 3 balls and one kite" in p.prompt and p.answer == "36"
    p = first("age")  # 12 + 11 now, + 20 years
    assert p.reference == " The sister will be 43 years old."
    p = first("order")
    assert "13, 12, 9" in p.prompt and p.answer == "9, 12, 13"


def test_load_task_dispatch(tmp_path):
    train, test = load_task(TaskConfig(name="explain", n_train=10, n_test=5))
    assert len(train) == 10 and len(test) == 5
    path = tmp_path / "d.jsonl"
    rows = [{"id": i, "prompt": f"Q{i}?", "reference": f" A{i}."} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    train, test = load_task(TaskConfig(name="reference_file", train_path=str(path), n_test=2))
    assert [p.id for p in test] == ["8", "9"] and train[0].reference == " A0."
    with pytest.raises(ValueError, match="train_path is required"):
        TaskConfig(name="reference_file")


def test_reference_loader_fields_and_errors(tmp_path):
    path = tmp_path / "refs.jsonl"
    path.write_text(
        json.dumps({"id": "a", "prompt": "Revise.", "reference": "\nThe revised text.\n"})
        + "\n"
        + json.dumps(
            {"id": 7, "prompt": "2+2?", "reference": " 4", "answer": 4, "solution": "2+2=4"}
        )
    )
    a, b = load_reference_problems(path)
    assert (a.id, a.reference, a.answer, a.solution) == ("a", "\nThe revised text.\n", "", "")
    assert (b.id, b.reference, b.answer, b.solution) == ("7", " 4", "4", "2+2=4")
    # the verifiable loader treats `reference` as a solution and needs an answer
    with pytest.raises(ValueError, match=r"row 1: missing field\(s\) \['answer'\]"):
        load_problems(path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "prompt": "p", "reference": "  "}))
    with pytest.raises(ValueError, match="row 1: field 'reference' is empty"):
        load_reference_problems(bad)
    bad.write_text(json.dumps({"id": "x", "prompt": "p"}))
    with pytest.raises(ValueError, match=r"missing field\(s\) \['reference'\]"):
        load_reference_problems(bad)
    bad.write_text(json.dumps({"id": "x", "prompt": "p", "reference": 3}))
    with pytest.raises(ValueError, match="'reference' must be str"):
        load_reference_problems(bad)
