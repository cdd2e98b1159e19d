"""Render a problem into prompt token ids: through the tokenizer's chat template, or as raw text."""

from __future__ import annotations

from typing import Any

from rlvr.tasks.base import Problem

DEFAULT_INSTRUCTION = "Put your final answer in \\boxed{}."
PROMPT_SLOT = "{prompt}"
"""Where the problem goes in an instruction that is a template (task.instruction)."""


def prompt_text(problem: Problem, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The prompt's text: `with_instruction(problem.prompt, instruction)`. A prompt given as chat
    messages has no raw text (ValueError naming the problem): it renders only through a chat
    template."""
    if problem.messages:
        raise ValueError(
            f"problem {problem.id!r}: its prompt is a list of chat messages, which "
            "task.chat_template=false cannot render as raw text"
        )
    return with_instruction(problem.prompt, instruction)


def with_instruction(text: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The instruction with `text` in its `PROMPT_SLOT` (a few-shot template), else `text`
    followed by the instruction. Trailing whitespace is kept (a raw prompt may end in the newline
    after which the answer starts)."""
    if PROMPT_SLOT in instruction:
        return instruction.replace(PROMPT_SLOT, text)
    return f"{text} {instruction}".lstrip() if instruction else text


def prompt_messages(
    problem: Problem, instruction: str = DEFAULT_INSTRUCTION
) -> list[dict[str, str]]:
    """The chat turns of a prompt: one user turn holding `prompt_text`, or the problem's own
    `messages` with the instruction applied to the last (user) turn."""
    if problem.messages:
        *before, (role, last) = problem.messages
        turns = [{"role": r, "content": c} for r, c in before]
        return [*turns, {"role": role, "content": with_instruction(last, instruction)}]
    return [{"role": "user", "content": prompt_text(problem, instruction)}]


def render_prompt(
    tokenizer: Any,
    problem: Problem,
    instruction: str = DEFAULT_INSTRUCTION,
    chat_template: bool = True,
) -> list[int]:
    """Token ids of the prompt, ending where the answer starts.

    `chat_template` (task.chat_template) renders `prompt_messages` (one user turn, or the
    problem's own chat turns) through the tokenizer's chat template with the assistant's turn
    opened; otherwise the raw `prompt_text`, with only the special tokens the tokenizer adds to
    plain text (a BOS where it has one), as DRO trains (arXiv:2506.13351, App. F.2) and as a base
    model without a template needs. Generation
    backends and the trainer take these ids as they are, so every component sees the same tokens.
    """
    if not chat_template:
        return render_text(tokenizer, prompt_text(problem, instruction))
    return render_messages(tokenizer, prompt_messages(problem, instruction))


def render_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a raw prompt, with the special tokens the tokenizer adds to plain text."""
    return [int(i) for i in tokenizer(text)["input_ids"]]


def render_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat turns through the tokenizer's chat template, the assistant's turn open;
    ValueError if the tokenizer has none."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of {tokenizer.name_or_path or 'this model'} has no chat template; "
            "set task.chat_template=false to render raw prompts"
        )
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(i) for i in ids]
