"""Prompt rendering: the chat template turns a problem into the exact token ids generation sees."""

import pytest
from transformers import AutoTokenizer

from rlvr.models.tiny import build_tiny_model
from rlvr.tasks import ArithmeticTask, Problem
from rlvr.tasks.prompts import DEFAULT_INSTRUCTION, prompt_messages, render_prompt

PROBLEM = Problem(id="p", prompt="Compute 2 + 3.", answer="5")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = list(ArithmeticTask(seed=0).corpus(100))
    path = build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0, corpus=corpus)
    return AutoTokenizer.from_pretrained(path)


def test_messages():
    assert prompt_messages(PROBLEM, "Box it.") == [
        {"role": "user", "content": "Compute 2 + 3. Box it."}
    ]
    assert prompt_messages(PROBLEM, "") == [{"role": "user", "content": "Compute 2 + 3."}]
    assert DEFAULT_INSTRUCTION == "Put your final answer in \\boxed{}."


def test_render_prompt_is_the_chat_template_as_plain_ints(tokenizer):
    ids = render_prompt(tokenizer, PROBLEM)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == (
        "<|user|>\nCompute 2 + 3. Put your final answer in \\boxed{}.<|endoftext|>\n<|assistant|>\n"
    )
    expected = tokenizer(
        "<|user|>\nCompute 2 + 3. Put your final answer in \\boxed{}.<|endoftext|>\n<|assistant|>\n",
        add_special_tokens=False,
    )["input_ids"]
    assert ids == expected
    assert render_prompt(tokenizer, PROBLEM, "Box it.") != ids
