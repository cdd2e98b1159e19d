"""Prompt rendering: the chat template (or the raw text) turns a problem into the exact token ids
generation sees."""

import copy

import pytest
from transformers import AutoTokenizer

from rlvr.models.tiny import build_tiny_model
from rlvr.tasks import ArithmeticTask, Problem
from rlvr.tasks.prompts import DEFAULT_INSTRUCTION, prompt_messages, prompt_text, render_prompt

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


def test_an_instruction_with_a_prompt_slot_is_a_template():
    few_shot = "Q: Compute 1 + 1.\nA: \\boxed{2}\n\nQ: {prompt}\nA:"
    assert prompt_text(PROBLEM, few_shot) == (
        "Q: Compute 1 + 1.\nA: \\boxed{2}\n\nQ: Compute 2 + 3.\nA:"
    )
    assert prompt_messages(PROBLEM, "{prompt} Box it.") == prompt_messages(PROBLEM, "Box it.")


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


def test_raw_rendering_is_the_prompt_text_without_chat_markup(tokenizer):
    ids = render_prompt(tokenizer, PROBLEM, chat_template=False)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == "Compute 2 + 3. Put your final answer in \\boxed{}."
    assert ids == tokenizer(prompt_text(PROBLEM))["input_ids"]
    assert not set(ids) & set(tokenizer.all_special_ids)  # the tiny tokenizer adds no BOS
    assert render_prompt(tokenizer, PROBLEM, "Box it.", chat_template=False) != ids
    newline = render_prompt(tokenizer, PROBLEM, "Box it.\n", chat_template=False)
    assert tokenizer.decode(newline) == "Compute 2 + 3. Box it.\n"


def test_chat_rendering_without_a_template_names_the_flag(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="task.chat_template=false"):
        render_prompt(bare, PROBLEM)
    assert render_prompt(bare, PROBLEM, chat_template=False) == render_prompt(
        tokenizer, PROBLEM, chat_template=False
    )


CHAT = Problem(
    id="c",
    prompt="Compute 2 + 3.",
    answer="5",
    messages=(("system", "Be brief."), ("user", "Compute 2 + 3.")),
)


def test_chat_messages_render_as_turns_with_the_instruction_in_the_last(tokenizer):
    assert prompt_messages(CHAT, "Box it.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Compute 2 + 3. Box it."},
    ]
    assert prompt_messages(CHAT, "Q: {prompt}\nA:")[-1]["content"] == "Q: Compute 2 + 3.\nA:"
    ids = render_prompt(tokenizer, CHAT, "Box it.")
    assert ids == tokenizer.apply_chat_template(
        prompt_messages(CHAT, "Box it."),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert tokenizer.decode(ids).startswith("<|system|>\nBe brief.")
    with pytest.raises(ValueError, match=r"problem 'c': its prompt is a list of chat messages"):
        render_prompt(tokenizer, CHAT, chat_template=False)
