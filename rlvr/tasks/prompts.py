"""Render a problem into prompt token ids through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from rlvr.tasks.base import Problem

DEFAULT_INSTRUCTION = "Put your final answer in \\boxed{}."


def prompt_messages(
    problem: Problem, instruction: str = DEFAULT_INSTRUCTION
) -> list[dict[str, str]]:
    """The chat turns of a prompt: one user turn, the problem followed by the instruction."""
    content = f"{problem.prompt} {instruction}".strip() if instruction else problem.prompt
    return [{"role": "user", "content": content}]


def render_prompt(
    tokenizer: Any, problem: Problem, instruction: str = DEFAULT_INSTRUCTION
) -> list[int]:
    """Token ids of the chat-formatted prompt, ending where the assistant's answer starts.

    `tokenizer` is a transformers tokenizer with a chat template; generation backends and the
    trainer take these ids as they are, so every component sees the same prompt tokens.
    """
    ids = tokenizer.apply_chat_template(
        prompt_messages(problem, instruction),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return [int(i) for i in ids]
