"""Tools and environments passed to the Python API as objects defined here (a test module the
tool sandbox cannot import; Ray sends them to the actors by value, as a notebook's): a tool
function answers the warm-up's traced calls in its sandbox and loads in the engines' tool loop,
an environment class plays every trajectory in its own process (tests/envs/test_python_objects.py
checks it step by step against its string form), and a run stopped after its first step resumes
with the config that holds it."""

from __future__ import annotations

import ast
import operator

import pytest

import rlvr
from rlvr.envs.base import StepResult
from rlvr.run.rundir import RunDir

pytestmark = pytest.mark.ray

FAST = {
    "task.n_test": 16,  # the other integration tests' task: their cached warm-up model serves
    "generation.prompts_per_step": 2,
    "generation.group_size": 2,
    "generation.max_tokens": 16,
    "run.eval_every": 0,
    "run.loggers": [],
    "resources.num_verifiers": 1,
    "resources.torch_threads": 1,  # beside another test worker (conftest.FAST)
}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("only integers, +, - and * are allowed")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: The expression, e.g. "47 * 86".
    """
    return str(_value(ast.parse(expression, mode="eval").body))


def test_a_tool_defined_here_is_called_by_the_warm_up_and_announced_to_the_model(
    tmp_path, driver_env
):
    cfg = rlvr.load_config(
        "tiny",
        {
            **FAST,
            "run.steps": 1,
            "run.output_dir": str(tmp_path),
            "run.name": "tools",
            "env.kind": "tools",
            "env.tools": [calculate],
            "env.max_turns": 2,
            # the traces call the tool in its sandbox for each warm-up problem and keep its
            # result; a call that fails stops the run before any actor starts
            "model.sft_warmup_traces": "tool_calls",
            "model.sft_warmup_steps": 2,
            "model.sft_warmup_problems": 8,
            "model.sft_warmup_batch_size": 2,
            "generation.max_model_len": 1024,  # the prompt holds the tool's schema
        },
    )
    summary = rlvr.train(cfg)
    assert summary["steps"] == 1
    run = RunDir(tmp_path / "tools")
    assert run.load_config_dict()["env"]["tools"] == [f"{__name__}:calculate"]
    rollouts = run.read_rollouts()
    assert rollouts and all(r["flags"]["agent"]["turns"] >= 1 for r in rollouts)


def test_an_environment_class_defined_here_plays_and_resumes(tmp_path, driver_env, run_records):
    class Guess:
        """tests.envs.sample_envs.GuessTheAnswer, written again here."""

        def __init__(self, tries: int = 3):
            self.tries = tries

        def reset(self, problem):
            self.answer = problem.answer
            return [{"role": "user", "content": f"{problem.prompt} You have {self.tries} tries."}]

        def step(self, assistant_message: str) -> StepResult:
            self.tries -= 1
            if assistant_message.strip() == self.answer:
                return StepResult([], 1.0, True, {"tries_left": self.tries})
            if self.tries == 0:
                return StepResult([], 0.0, True, {"tries_left": 0})
            hint = {"role": "user", "content": f"No. {self.tries} tries left."}
            return StepResult([hint], None, False, {"tries_left": self.tries})

    common = {
        **FAST,
        "run.steps": 3,
        "run.output_dir": str(tmp_path),
        "env.kind": "python",
        "env.kwargs": {"tries": 2},
        "env.max_turns": 2,
    }
    cfg = rlvr.load_config("tiny", {**common, "run.name": "by-object", "env.class": Guess})
    run = rlvr.train(cfg, background=True)
    for record in run:
        if record["step"] == 0:
            run.stop()
    assert run.status == "stopped" and run.last_step < 2
    with pytest.raises(rlvr.ConfigError, match=r"started with Python objects \(.*Guess\)"):
        rlvr.train(resume=run.run_dir)  # its config.yaml only names the class
    summary = run.resume(background=False)
    assert summary["steps"] == 3
    rollouts = run_records(run.run_dir, "rollouts.jsonl")
    assert [r["step"] for r in rollouts] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(r["status"] == "environment" for r in rollouts)
    assert all(r["flags"]["agent"]["turns"] >= 1 for r in rollouts)
