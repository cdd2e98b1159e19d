"""Render a problem into prompt token ids through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from rlvr.tasks.base import Problem


def prompt_messages(problem: Problem, instruction: str) -> list[dict[str, str]]:
    content = f"{problem.prompt} {instruction}".strip() if instruction else problem.prompt
    return [{"role": "user", "content": content}]


def render_prompt(tokenizer: Any, problem: Problem, instruction: str) -> list[int]:
    """Token ids of the chat-formatted prompt, ending where the assistant's answer starts."""
    ids = tokenizer.apply_chat_template(
        prompt_messages(problem, instruction), add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
