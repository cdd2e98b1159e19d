"""Verifiable tasks: the procedural arithmetic task and user datasets, chosen by config."""

from __future__ import annotations

from typing import Any

from rlvr.tasks.arithmetic import ArithmeticDifficulty, ArithmeticTask
from rlvr.tasks.base import Problem
from rlvr.tasks.loaders import load_problems


def load_task(task_cfg: Any) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems for a `TaskConfig` (procedural arithmetic or dataset files).

    A dataset without a test file holds out the last fifth of its training file (at most
    `n_test` problems), deterministically.
    """
    if task_cfg.name == "arithmetic":
        task = ArithmeticTask(
            ArithmeticDifficulty(**task_cfg.difficulty.model_dump()),
            seed=task_cfg.seed,
            n_test=task_cfg.n_test,
        )
        return task.problems("train", task_cfg.n_train), task.problems("test", task_cfg.n_test)
    train = load_problems(task_cfg.train_path)
    test = load_problems(task_cfg.test_path) if task_cfg.test_path else []
    if not test:
        cut = max(1, min(task_cfg.n_test, len(train) // 5))
        train, test = train[:-cut], train[-cut:]
    return train, test


__all__ = ["ArithmeticDifficulty", "ArithmeticTask", "Problem", "load_problems", "load_task"]
