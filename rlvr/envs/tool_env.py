"""The built-in environment: the tool-calling loop. The model's message is parsed for tool calls
(rlvr.envs.parsers); each call runs in its own sandbox (rlvr.envs.tools) and its result comes
back as a `tool` message; a message without a call is the final answer, which ends the episode
with no reward of the environment's (the verifier scores it).

What the model can and cannot do to it: every call it writes, readable or not, is answered in
order by one tool message, and only the first `max_calls_per_turn` run (the rest are answered
"too_many_calls"). Tool results exist only as the environment's observations: text in the
assistant's message that looks like a result (`<tool_response>`, a tool-role marker) is its own
text, never read, never run. The environment holds no state across steps, and it never raises:
a failed call is an error message and a status (`info["tool_calls"]`: one {"name", "status"}
per call, statuses from rlvr.envs.tools.TOOL_STATUSES) for metrics.
"""

from __future__ import annotations

from rlvr.envs.base import Environment, Message, StepResult
from rlvr.envs.parsers import ParseError, ToolCallParser, get_parser
from rlvr.envs.tools import ToolBox, ToolResult
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import DEFAULT_INSTRUCTION, prompt_messages

__all__ = ["ToolEnvironment"]


class ToolEnvironment(Environment):
    """The tool-calling loop over `toolbox`'s tools, calls read by `parser`; the prompt is the
    problem's, with `instruction` (as single-turn rollouts render it). Cheap to make: one per
    trajectory, sharing the ToolBox."""

    def __init__(
        self,
        toolbox: ToolBox,
        parser: ToolCallParser | str = "hermes",
        instruction: str = DEFAULT_INSTRUCTION,
        max_calls_per_turn: int = 4,
    ):
        if max_calls_per_turn < 1:
            raise ValueError("max_calls_per_turn must be >= 1")
        self.toolbox = toolbox
        self.parser = get_parser(parser) if isinstance(parser, str) else parser
        self.instruction = instruction
        self.max_calls_per_turn = max_calls_per_turn
        self.tools = toolbox.schemas

    def reset(self, problem: Problem) -> list[Message]:
        return prompt_messages(problem, self.instruction)

    def step(self, assistant_message: str) -> StepResult:
        parsed = self.parser.parse(assistant_message)
        items = parsed.in_order()
        if not items:
            return StepResult([], None, True, {"tool_calls": []})
        results = []
        for n, item in enumerate(items):
            if isinstance(item, ParseError):
                error = f"Error: the tool call could not be read: {item.reason}"
                results.append(ToolResult(item.name, "parse_error", error))
            elif n >= self.max_calls_per_turn:
                error = f"Error: not run; at most {self.max_calls_per_turn} tool calls per message"
                results.append(ToolResult(item.name, "too_many_calls", error))
            else:
                results.append(self.toolbox.call(item.name, item.arguments))
        return StepResult(
            [r.message() for r in results],
            None,
            False,
            {"tool_calls": [{"name": r.name, "status": r.status} for r in results]},
        )
