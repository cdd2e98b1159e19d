"""Arithmetic task: hand-checked rendering, determinism, difficulty knobs, disjoint splits."""

import hashlib
import re

import pytest

from rlvr.answers import last_boxed
from rlvr.config import load_config
from rlvr.tasks import ArithmeticDifficulty, ArithmeticTask, load_task
from rlvr.tasks.arithmetic import _expression, _solution


def _replay(solution: str) -> int:
    """Re-derive the answer from the solution's step lines (a op b = c), checking each line."""
    value = None
    for line in solution.splitlines()[:-1]:
        m = re.fullmatch(r"(-?\d+) ([+\-*]) (\d+) = (-?\d+)", line)
        assert m, line
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert value is None or a == value
        assert c == {"+": a + b, "-": a - b, "*": a * b}[op]
        value = c
    return value


def test_rendering_by_hand():
    computation = (12, (("+", 5), ("*", 3), ("-", 4)))
    assert _expression(computation) == "Compute (12 + 5) * 3 - 4."
    assert _expression((6, (("*", 2), ("*", 3), ("+", 1)))) == "Compute 6 * 2 * 3 + 1."
    assert _solution(computation) == (
        "12 + 5 = 17\n17 * 3 = 51\n51 - 4 = 47\nThe answer is \\boxed{47}."
    )


def test_stream_is_pinned():
    # Other components key per-prompt state by id, and configs were tuned on these exact problems.
    first = ArithmeticTask(seed=0).problems("test", 1)[0]
    assert (first.prompt, first.answer) == ("Compute 11 - 7 + 17.", "21")
    assert first.solution == "11 - 7 = 4\n4 + 17 = 21\nThe answer is \\boxed{21}."
    assert first.id == "arith-" + hashlib.sha1(b"Compute 11 - 7 + 17.").hexdigest()[:12]


@pytest.mark.parametrize("style", ["expression", "words", "mixed"])
def test_answers_and_solutions_agree(style):
    task = ArithmeticTask(ArithmeticDifficulty(1, 3, 30, "+-*", style), seed=5)
    for p in task.problems("train", 200):
        assert last_boxed(p.solution) == p.answer
        assert _replay(p.solution) == int(p.answer) >= 0
        assert p.solution.endswith(f"The answer is \\boxed{{{p.answer}}}.")


def test_expression_prompt_evaluates_to_answer():
    task = ArithmeticTask(ArithmeticDifficulty(1, 3, 30, "+-*", "expression"), seed=1)
    for p in task.problems("test", 100):
        expr = p.prompt.removeprefix("Compute ").removesuffix(".")
        assert eval(expr) == int(p.answer)  # noqa: S307 - our own generated arithmetic


def test_word_problem_reads_like_the_solution():
    task = ArithmeticTask(ArithmeticDifficulty(2, 2, 20, "+-", "words"), seed=0)
    for p in task.problems("test", 30):
        m = re.fullmatch(
            r"(\w+) has (\d+) (\w+)\. (He|She) (.+), then (.+)\. How many (\w+) does (he|she) have now\?",
            p.prompt,
        )
        assert m, p.prompt
        assert m[4].lower() == m[8]
        steps = p.solution.splitlines()
        assert steps[0].startswith(f"{m[2]} ")
        for clause, step in zip((m[5], m[6]), steps, strict=False):
            operand = step.split(" = ")[0].split()[-1]
            assert re.search(rf"\b{operand}\b", clause)


def test_deterministic_and_seed_dependent():
    d = ArithmeticDifficulty(1, 2, 20, "+-", "mixed")
    a = ArithmeticTask(d, seed=0).problems("train", 50)
    assert a == ArithmeticTask(d, seed=0).problems("train", 50)
    assert a != ArithmeticTask(d, seed=1).problems("train", 50)
    assert len({p.id for p in a}) == 50
    # a longer request extends a shorter one
    assert ArithmeticTask(d, seed=0).problems("train", 80)[:50] == a


def test_step_counts_and_operators_respect_difficulty():
    task = ArithmeticTask(ArithmeticDifficulty(2, 3, 10, "+", "expression"), seed=0)
    problems = task.problems("train", 100)
    assert {p.prompt.count("+") for p in problems} == {2, 3}
    for p in problems:
        assert all(1 <= int(n) <= 10 for n in re.findall(r"\d+", p.prompt))


@pytest.mark.parametrize("style", ["expression", "words"])
def test_splits_are_disjoint_by_computation(style):
    # 1 step, operands <= 6, '+': only 36 computations exist, so collisions are certain to be drawn.
    task = ArithmeticTask(ArithmeticDifficulty(1, 1, 6, "+", style), seed=0, n_test=10)
    test, train = task.problems("test", 10), task.problems("train", 26)
    # the solution spells out the computation, whatever the wording of the prompt
    assert not {p.solution for p in test} & {p.solution for p in train}
    assert len({p.solution for p in train}) == 26
    assert task.problems("test", 4) == test[:4]


def test_request_limits_fail_clearly():
    task = ArithmeticTask(ArithmeticDifficulty(1, 1, 2, "+", "expression"), seed=0, n_test=2)
    with pytest.raises(ValueError, match="distinct train"):
        task.problems("train", 5)  # 4 computations exist, 2 are held out
    with pytest.raises(ValueError, match="holds out 2"):
        task.problems("test", 3)
    with pytest.raises(ValueError, match="split"):
        task.problems("validation", 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_steps": 0},
        {"min_steps": 3, "max_steps": 2},
        {"max_operand": 1},
        {"operators": "/"},
        {"operators": ""},
        {"style": "poem"},
    ],
)
def test_bad_difficulty_rejected(kwargs):
    with pytest.raises(ValueError):
        ArithmeticDifficulty(**kwargs)


def test_corpus_covers_prompts_and_solutions():
    task = ArithmeticTask(seed=0)
    texts = list(task.corpus(3))
    assert len(texts) == 12
    assert texts[0].startswith("Compute ") and "\\boxed{" in texts[1]


def test_load_task_from_config():
    cfg = load_config(None, ["task.n_train=30", "task.n_test=10"])
    train, test = load_task(cfg.task)
    assert len(train) == 30 and len(test) == 10
    assert not {p.prompt for p in train} & {p.prompt for p in test}


def test_load_task_from_a_file_holds_out_its_tail(tmp_path):
    rows = [f'{{"id": "q{i}", "prompt": "p{i}", "answer": "{i}"}}' for i in range(10)]
    (tmp_path / "d.jsonl").write_text("\n".join(rows))
    cfg = load_config(
        None, ["task.name=file", f"task.train_path={tmp_path / 'd.jsonl'}", "task.n_test=5"]
    )
    train, test = load_task(cfg.task)
    assert [p.id for p in test] == ["q8", "q9"]  # a fifth of 10, capped by n_test
    assert len(train) == 8


def test_verbosity_pads_solutions_only():
    plain = ArithmeticTask(ArithmeticDifficulty(max_steps=3), seed=1).problems("train", 50)
    verbose = ArithmeticTask(ArithmeticDifficulty(max_steps=3, verbosity=3), seed=1)
    padded = verbose.problems("train", 50)
    assert [p.id for p in padded] == [p.id for p in plain]  # same problems, same answers
    assert [p.answer for p in padded] == [p.answer for p in plain]
    checks = []
    for p, q in zip(plain, padded, strict=True):
        steps = p.solution.count("\n")  # one line per step before the answer line
        lines = q.solution.splitlines()
        extra = [line for line in lines if line.startswith("Check again: ")]
        assert [line for line in lines if line not in extra] == p.solution.splitlines()
        assert 0 <= len(extra) <= 3 * steps
        checks.append(len(extra))
    assert min(checks) < max(checks)  # the corpus spans several lengths
    assert padded == verbose.problems("train", 50)  # deterministic


def test_long_reasoning_solutions_box_the_answer_correct_and_spread():
    """reasoning='long' (DUET's regime, arXiv:2605.08441): every trace ends in the boxed gold
    answer, some steps slip and are corrected, and lengths spread."""
    difficulty = ArithmeticDifficulty(
        min_steps=1, max_steps=4, max_operand=30, operators="+-*", style="mixed", reasoning="long"
    )
    problems = ArithmeticTask(difficulty, seed=0).problems("train", 300)
    for p in problems:
        last = p.solution.splitlines()[-1]
        assert last == f"So the final answer is \\boxed{{{p.answer}}}."
    corrected = [p for p in problems if "Wait, " in p.solution]
    assert 0.2 < len(corrected) / len(problems) < 0.8
    for p in corrected:
        wait = next(line for line in p.solution.splitlines() if line.startswith("Wait, "))
        assert ", not " in wait and "So the result is" in wait
    lengths = sorted(len(p.solution) for p in problems)
    assert lengths[-1] > 4 * lengths[0]


def test_reasoning_is_validated_and_short_keeps_the_old_solutions():
    with pytest.raises(ValueError, match="reasoning"):
        ArithmeticDifficulty(reasoning="medium")
    old = ArithmeticTask(ArithmeticDifficulty(), seed=0).problems("train", 3)
    # seed 0's first problems exactly as the generator wrote them before `reasoning` existed
    assert [(p.prompt, p.solution) for p in old] == [
        ("Compute 18 - 5 + 1.", "18 - 5 = 13\n13 + 1 = 14\nThe answer is \\boxed{14}."),
        ("Compute 2 + 17.", "2 + 17 = 19\nThe answer is \\boxed{19}."),
        ("Compute 13 - 8 - 4.", "13 - 8 = 5\n5 - 4 = 1\nThe answer is \\boxed{1}."),
    ]


def test_config_rejects_a_bad_reasoning_naming_the_key():
    with pytest.raises(ValueError, match="task.difficulty.reasoning"):
        load_config(None, ["task.difficulty.reasoning=medium"])
    cfg = load_config("configs/smollm2-duet-long.yaml", [])
    assert cfg.task.difficulty.reasoning == "long" and cfg.generation.max_tokens >= 256
