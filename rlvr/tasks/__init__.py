"""Tasks chosen by config: procedural arithmetic, procedural code (assert tests), procedural
explain-then-answer (reference answers, no verifier), and user datasets with gold answers or with
reference answers."""

from __future__ import annotations

from typing import Any

from rlvr.tasks.arithmetic import ArithmeticDifficulty, ArithmeticTask
from rlvr.tasks.base import Problem
from rlvr.tasks.code import CodeTask
from rlvr.tasks.explain import ExplainTask
from rlvr.tasks.loaders import load_problems, load_reference_problems


def load_task(task_cfg: Any) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems for a `TaskConfig` (procedural arithmetic or dataset files).

    Dataset files are read with the task's field map (task.fields) and, under
    task.chat_template=false, refuse prompts given as chat messages. A dataset without a test file
    holds out the last fifth of its training file (at most
    `n_test` problems), deterministically.
    """
    if task_cfg.name == "arithmetic":
        task = ArithmeticTask(
            ArithmeticDifficulty(**task_cfg.difficulty.model_dump()),
            seed=task_cfg.seed,
            n_test=task_cfg.n_test,
        )
        return task.problems("train", task_cfg.n_train), task.problems("test", task_cfg.n_test)
    if task_cfg.name == "code":
        difficulty = task_cfg.difficulty
        task = CodeTask(
            seed=task_cfg.seed,
            max_operand=difficulty.max_operand,
            min_steps=difficulty.min_steps,
            max_steps=difficulty.max_steps,
        )
        return task.problems("train", task_cfg.n_train), task.problems("test", task_cfg.n_test)
    if task_cfg.name == "explain":
        task = ExplainTask(
            seed=task_cfg.seed, n_test=task_cfg.n_test, max_operand=task_cfg.difficulty.max_operand
        )
        return task.problems("train", task_cfg.n_train), task.problems("test", task_cfg.n_test)
    fields = task_cfg.fields.mapping() or None
    if task_cfg.name == "reference_file":

        def load(path: str) -> list[Problem]:
            return load_reference_problems(path, fields)
    else:

        def load(path: str) -> list[Problem]:
            return load_problems(path, fields, task_cfg.chat_template)

    train = load(task_cfg.train_path)
    test = load(task_cfg.test_path) if task_cfg.test_path else []
    if not test:
        cut = max(1, min(task_cfg.n_test, len(train) // 5))
        train, test = train[:-cut], train[-cut:]
    return train, test


__all__ = [
    "ArithmeticDifficulty",
    "ArithmeticTask",
    "CodeTask",
    "ExplainTask",
    "Problem",
    "load_problems",
    "load_reference_problems",
    "load_task",
]
