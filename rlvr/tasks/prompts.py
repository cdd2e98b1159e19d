"""Render a problem into prompt token ids: through the tokenizer's chat template, or as raw text."""

from __future__ import annotations

from typing import Any

from rlvr.tasks.base import Problem

DEFAULT_INSTRUCTION = "Put your final answer in \\boxed{}."
PROMPT_SLOT = "{prompt}"
"""Where the problem goes in an instruction that is a template (task.instruction)."""


def prompt_text(problem: Problem, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The prompt's text: the instruction with the problem in its `PROMPT_SLOT` (a few-shot
    template), else the problem followed by the instruction. Trailing whitespace is kept (a raw
    prompt may end in the newline after which the answer starts)."""
    if PROMPT_SLOT in instruction:
        return instruction.replace(PROMPT_SLOT, problem.prompt)
    return f"{problem.prompt} {instruction}".lstrip() if instruction else problem.prompt


def prompt_messages(
    problem: Problem, instruction: str = DEFAULT_INSTRUCTION
) -> list[dict[str, str]]:
    """The chat turns of a prompt: one user turn holding `prompt_text`."""
    return [{"role": "user", "content": prompt_text(problem, instruction)}]


def render_prompt(
    tokenizer: Any,
    problem: Problem,
    instruction: str = DEFAULT_INSTRUCTION,
    chat_template: bool = True,
) -> list[int]:
    """Token ids of the prompt, ending where the answer starts.

    `chat_template` (task.chat_template) renders one user turn through the tokenizer's chat
    template with the assistant's turn opened; otherwise the raw `prompt_text`, with only the
    special tokens the tokenizer adds to plain text (a BOS where it has one), as DRO trains
    (arXiv:2506.13351, App. F.2) and as a base model without a template needs. Generation
    backends and the trainer take these ids as they are, so every component sees the same tokens.
    """
    if not chat_template:
        return [int(i) for i in tokenizer(prompt_text(problem, instruction))["input_ids"]]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of {tokenizer.name_or_path or 'this model'} has no chat template; "
            "set task.chat_template=false to render raw prompts"
        )
    ids = tokenizer.apply_chat_template(
        prompt_messages(problem, instruction),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return [int(i) for i in ids]
