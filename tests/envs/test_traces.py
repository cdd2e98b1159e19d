"""Warm-up traces of a calculator-using model: each problem's call and its answer after the tool's
real result, rendered exactly as a rollout of the tool-calling loop would hold them, and the
warm-up that trains on them."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rlvr.envs.parsers import get_parser
from rlvr.envs.rollout import Agents, EnvSettings
from rlvr.envs.traces import calculator_call, tool_call_examples
from rlvr.models.sft import MARKER, sft_warmup
from rlvr.tasks.arithmetic import ArithmeticDifficulty, ArithmeticTask
from rlvr.tasks.base import Problem

CALCULATOR = EnvSettings(kind="tools", tools=("rlvr.envs.builtin_tools:calculate",))
PRODUCTS = ArithmeticDifficulty(1, 1, 99, "*", "expression", max_multiplier=99)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_products_reach_the_multiplier_asked_for():
    problems = ArithmeticTask(PRODUCTS, seed=0).problems("train", 40)
    factors = [int(f) for p in problems for f in p.prompt[8:-1].split(" * ")]
    assert max(factors) > 20  # the default multiplier keeps products' second factor <= 5
    assert all(int(p.answer) == eval(p.prompt[8:-1]) for p in problems)  # noqa: S307


def test_each_problem_gives_its_call_then_its_answer_as_a_rollout_would_hold_them(tokenizer):
    problems = ArithmeticTask(PRODUCTS, seed=0).problems("train", 3)
    examples = tool_call_examples(CALCULATOR, tokenizer, problems)
    assert len(examples) == 2 * len(problems)
    agents = Agents(CALCULATOR, tokenizer)
    for k, problem in enumerate(problems):
        (prompt, call), (answer_prompt, answer) = examples[2 * k : 2 * k + 2]
        env = agents.environment()
        renderer = agents.renderer(env.tools)
        assert prompt == renderer.prompt_ids(env.reset(problem))
        assert call[-1] == answer[-1] == tokenizer.eos_token_id
        [parsed] = get_parser("hermes").parse(tokenizer.decode(call[:-1])).calls
        assert (parsed.name, parsed.arguments) == calculator_call(problem)
        # the second turn's prompt is the first's, the call, then the observation spliced in
        call_text = tokenizer.decode(call[:-1])
        conversation = [*env.reset(problem), {"role": "assistant", "content": call_text}]
        observation = env.step(call_text).observations
        spliced = renderer.observation_ids(conversation, call, observation)
        assert answer_prompt == prompt + call + spliced
        assert f"<tool_response>\n{problem.answer}\n</tool_response>" in tokenizer.decode(spliced)
        assert tokenizer.decode(answer[:-1]) == f"\\boxed{{{problem.answer}}}"


def test_problems_without_a_call_are_skipped_and_none_at_all_is_an_error(tokenizer):
    words = Problem("w", "Tom has 3 apples. He buys 2 more. How many?", "5")
    plus = Problem("e", "Compute 3 + 4.", "7")
    assert len(tool_call_examples(CALCULATOR, tokenizer, [words, plus])) == 2
    with pytest.raises(ValueError, match="no problem has a tool call"):
        tool_call_examples(CALCULATOR, tokenizer, [words])
    with pytest.raises(ValueError, match="failed"):
        tool_call_examples(CALCULATOR, tokenizer, [Problem("z", "Compute 1 / 0.", "?")])
    with pytest.raises(ValueError, match="env.kind 'tools'"):
        tool_call_examples(EnvSettings(kind="python", env_class="x:Y"), tokenizer, [plus])


def test_the_warm_up_trains_on_the_traces(tiny_model_dir, tmp_path):
    problems = ArithmeticTask(PRODUCTS, seed=0).problems("train", 4)
    kwargs = {"steps": 2, "batch_size": 2, "lr": 1e-4}
    traced = sft_warmup(tiny_model_dir, problems, tmp_path / "t", tool_traces=CALCULATOR, **kwargs)
    plain = sft_warmup(tiny_model_dir, problems, tmp_path / "p", **kwargs)
    marks = [json.loads((d / MARKER).read_text()) for d in (traced, plain)]
    assert marks[0]["fingerprint"] != marks[1]["fingerprint"]
    assert marks[0]["tool_traces"]["tools"] == list(CALCULATOR.tools)
    assert "tool_traces" not in marks[1]
