"""Warm-up traces for a tool-using model: per problem, the two turns of a model that calls a tool
and then answers, rendered exactly as the tool-calling loop renders its rollouts
(`rlvr.envs.rollout.Agents`): the call after the first prompt, then the boxed answer after the
tool's real result (the tool runs in its sandbox, as in a rollout). A model that never writes a
call gets no signal from its tools under RL; a short supervised warm-up on these traces starts it
where tools can pay off, as the DUET regime preset (configs/smollm2-duet-long.yaml) warms up
its answer marker.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from rlvr.envs.rollout import Agents, EnvSettings
from rlvr.envs.tool_env import ToolEnvironment
from rlvr.tasks.base import Problem

ToolCallFor = Callable[[Problem], "tuple[str, dict[str, Any]] | None"]
"""The (tool name, arguments) call that answers a problem, or None where no call does."""

_EXPRESSION = re.compile(r"Compute (.+)\.")


def calculator_call(problem: Problem) -> tuple[str, dict[str, Any]] | None:
    """The `calculate` call of an expression-style arithmetic problem ("Compute 47 * 86.")."""
    match = _EXPRESSION.fullmatch(problem.prompt)
    return None if match is None else ("calculate", {"expression": match.group(1)})


def tool_call_examples(
    settings: EnvSettings,
    tokenizer: Any,
    problems: Sequence[Problem],
    call_for: ToolCallFor = calculator_call,
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) pairs, two per problem that `call_for` answers: the call, and
    the answer `\\boxed{gold}` after the tool's result. ValueError when a traced call fails (the
    trace would teach the model a call that does not work) or no problem has a call."""
    if settings.kind != "tools":
        raise ValueError(f"tool-call traces need env.kind 'tools', not {settings.kind!r}")
    agents = Agents(settings, tokenizer)
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]

    examples: list[tuple[list[int], list[int]]] = []
    for problem in problems:
        call = call_for(problem)
        if call is None:
            continue
        env = agents.environment()
        assert isinstance(env, ToolEnvironment)
        messages = env.reset(problem)
        renderer = agents.renderer(env.tools)
        call_text = env.parser.write_call(*call)
        result = env.step(call_text)
        failed = [c for c in result.info["tool_calls"] if c["status"] != "ok"]
        if failed or result.done:
            raise ValueError(f"the traced call {call_text!r} of {problem.id} failed: {failed}")
        conversation = [*messages, {"role": "assistant", "content": call_text}]
        examples.append((renderer.prompt_ids(messages), ids(call_text)))
        answer_prompt = renderer.prompt_ids([*conversation, *result.observations])
        examples.append((answer_prompt, ids(f"\\boxed{{{problem.answer}}}")))
    if not examples:
        raise ValueError("no problem has a tool call to trace")
    return examples
