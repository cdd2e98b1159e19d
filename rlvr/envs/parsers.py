"""Tool calls read from an assistant message in the model's own format, by a parser chosen by
name (`get_parser`): "hermes", the Hermes / Qwen convention of `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks (several per message allowed), and "json", a message that
is nothing but a call object `{"name": ..., "arguments" (or "parameters"): {...}}` or a list of
them.

A parser reads a message into its calls, its text content, and the blocks that look like calls
but cannot be read (`ParseError`, never dropped: the model is told). Only call blocks are read:
any other markup in the message, a `<tool_response>` or a role marker included, is the
assistant's text and nothing more. For chat templates that know nothing of tools
(rlvr.envs.chat), a parser also says how the tools are announced in a system message and how
their results come back in a user turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PARSERS",
    "HermesParser",
    "JsonParser",
    "ParseError",
    "ParsedMessage",
    "ToolCall",
    "ToolCallParser",
    "get_parser",
]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
"""Standard JSON only: no NaN or Infinity in a call's arguments."""


@dataclass(frozen=True)
class ToolCall:
    """One readable call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    index: int
    """Its place among the message's call blocks, readable or not (0 first)."""

    def openai(self, call_id: str) -> dict[str, Any]:
        """The call in the OpenAI chat-completions format (`tool_calls` entries)."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass(frozen=True)
class ParseError:
    """A block that looks like a call but cannot be read."""

    reason: str
    text: str
    """The block as written (cut to 200 characters)."""
    index: int
    name: str = ""
    """The tool it names, where that much could be read."""


@dataclass(frozen=True)
class ParsedMessage:
    content: str
    """The message without its call blocks, stripped."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)

    def in_order(self) -> list[ToolCall | ParseError]:
        """Calls and parse errors in the order the message wrote them."""
        return sorted([*self.calls, *self.errors], key=lambda item: item.index)


def _call(
    value: Any, index: int, raw: str, argument_keys: tuple[str, ...]
) -> ToolCall | ParseError:
    """A decoded call object checked: {"name": str, <argument key>: {...}} (arguments may be
    left out for a tool without parameters)."""
    if type(value) is not dict:
        return ParseError("a tool call must be a JSON object", raw[:200], index)
    name = value.get("name")
    if type(name) is not str or not name:
        return ParseError('a tool call needs a "name" string', raw[:200], index)
    keys = [k for k in argument_keys if k in value]
    arguments = value[keys[0]] if keys else {}
    if type(arguments) is not dict:
        reason = f'"{keys[0]}" must be a JSON object'
        return ParseError(reason, raw[:200], index, name)
    return ToolCall(name, arguments, index)


class ToolCallParser:
    """How calls are written in a model's messages, and, for templates without tool support,
    how tools and their results are shown to it (the Hermes convention unless overridden)."""

    name = ""

    def parse(self, text: str) -> ParsedMessage:
        raise NotImplementedError

    def call_example(self) -> str:
        """How the model writes one call, for the system message that lists the tools."""
        return (
            '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
        )

    def write_call(self, name: str, arguments: dict[str, Any]) -> str:
        """One call as the model writes it (what `parse` reads back), for warm-up traces."""
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The tools announced to a model whose template does not render `tools=`."""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You can call tools. Each tool is described by a JSON schema inside <tools></tools>:"
            f"\n<tools>\n{listing}\n</tools>\n"
            f"To call a tool, write:\n{self.call_example()}\n"
            "The result comes back inside <tool_response></tool_response>. "
            "When you have the answer, reply without calling a tool."
        )

    def results_text(self, contents: list[str]) -> str:
        """The text of a user turn carrying tool results, for such a template."""
        return "\n".join(f"<tool_response>\n{c}\n</tool_response>" for c in contents)


class HermesParser(ToolCallParser):
    """`<tool_call>` JSON `</tool_call>` blocks anywhere in the message."""

    name = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def parse(self, text: str) -> ParsedMessage:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ParseError] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            content.append(text[pos:start])
            item, pos = self._block(text, start, len(calls) + len(errors))
            (calls if isinstance(item, ToolCall) else errors).append(item)
        content.append(text[pos:])
        return ParsedMessage("".join(content).strip(), calls, errors)

    def _block(self, text: str, start: int, index: int) -> tuple[ToolCall | ParseError, int]:
        """The call (or parse error) whose block opens at `start`, and where the block ends. The
        JSON is decoded as far as it goes, so a "</tool_call>" inside one of its strings does
        not end the block."""
        body = start + len(self.OPEN)
        begin = len(text) - len(text[body:].lstrip())
        try:
            value, end = _DECODER.raw_decode(text, begin)
        except (ValueError, RecursionError) as err:
            close = text.find(self.CLOSE, body)
            stop = len(text) if close < 0 else close + len(self.CLOSE)
            reason = f"no closing {self.CLOSE}" if close < 0 else f"not valid JSON ({err})"
            return ParseError(reason, text[start:stop][:200], index), stop
        after = len(text) - len(text[end:].lstrip())
        if not text.startswith(self.CLOSE, after):
            close = text.find(self.CLOSE, after)
            stop = len(text) if close < 0 else close + len(self.CLOSE)
            reason = f"no closing {self.CLOSE}" if close < 0 else "text after the JSON object"
            name = (
                value.get("name") if type(value) is dict and type(value.get("name")) is str else ""
            )
            return ParseError(reason, text[start:stop][:200], index, name), stop
        stop = after + len(self.CLOSE)
        return _call(value, index, text[start:stop], ("arguments",)), stop


class JsonParser(ToolCallParser):
    """A whole message that is one call object, or a list of them; any other message is text."""

    name = "json"
    _LOOKS_LIKE_CALL = re.compile(r'\s*\[?\s*\{\s*"name"\s*:')

    def write_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)

    def parse(self, text: str) -> ParsedMessage:
        if not self._LOOKS_LIKE_CALL.match(text):
            return ParsedMessage(text.strip())
        try:
            value = _DECODER.decode(text.strip())
        except (ValueError, RecursionError) as err:
            return ParsedMessage("", errors=[ParseError(f"not valid JSON ({err})", text[:200], 0)])
        values = value if type(value) is list else [value]
        items = [
            _call(v, i, json.dumps(v), ("arguments", "parameters")) for i, v in enumerate(values)
        ]
        return ParsedMessage(
            "",
            [c for c in items if isinstance(c, ToolCall)],
            [e for e in items if isinstance(e, ParseError)],
        )

    def call_example(self) -> str:
        return (
            '{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n'
            "as the whole message (a JSON list of such objects for several calls)"
        )


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "json": JsonParser}


def get_parser(name: str) -> ToolCallParser:
    """The tool-call parser `name` (one of `PARSERS`); ValueError naming the known ones."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name]()
