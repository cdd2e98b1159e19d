"""Procedural code task: seeded, disjoint splits, golds the code verifier accepts."""

import json

import pytest

from rlvr.config import ConfigError, config_from_dict, load_config
from rlvr.tasks import CodeTask, load_task
from rlvr.verifiers.code import CodeVerifier, parse_gold


def test_problems_are_seeded_distinct_and_split():
    task = CodeTask(seed=3)
    train, test = task.problems("train", 50), task.problems("test", 20)
    assert train == CodeTask(seed=3).problems("train", 50)
    assert len({p.id for p in train}) == len(train) == 50
    assert not {p.id for p in train} & {p.id for p in test}
    for p in train + test:
        assert parse_gold(p.answer)["asserts"]
        assert p.solution.startswith("```python\ndef f(x):")


def test_steps_pick_the_forms():
    easy = CodeTask(seed=0).problems("test", 500)
    assert easy == CodeTask(seed=0, min_steps=1, max_steps=2).problems("test", 500)
    hard = CodeTask(seed=0, min_steps=3, max_steps=3).problems("test", 500)
    assert not {p.id for p in easy} & {p.id for p in hard}
    assert any(" if x " in p.prompt for p in hard)
    with pytest.raises(ValueError, match="no code form has 4-5 steps"):
        CodeTask(min_steps=4, max_steps=5)


@pytest.mark.parametrize("max_steps", [2, 3])
def test_reference_solutions_pass_and_a_wrong_one_fails(max_steps):
    problems = CodeTask(seed=0, max_steps=max_steps).problems("test", 12)
    with CodeVerifier(num_workers=2, timeout=10.0) as v:
        assert v.verify_batch([p.solution for p in problems], [p.answer for p in problems]) == [
            (1.0, "correct")
        ] * len(problems)
        wrong = "```python\ndef f(x):\n    return 10**9\n```"
        assert v.verify(wrong, problems[0].answer) == (0.0, "wrong")


def test_config_loads_the_task_and_requires_the_code_verifier():
    cfg = load_config("configs/tiny-code.yaml")
    train, test = load_task(cfg.task)
    assert train and test and json.loads(train[0].answer)["asserts"]
    with pytest.raises(ConfigError, match="verifier.kind"):
        config_from_dict({"task": {"name": "code"}})
