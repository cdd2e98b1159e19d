"""A multi-turn conversation as token ids through the model's chat template, built turn by turn so
that the model's own sampled ids are never re-tokenized: turn t's prompt is turn t-1's prompt,
then the ids the model sampled, then the observation's ids (`ChatRenderer.observation_ids`).

How the observation's ids are made. The template is rendered (as text) twice: the conversation
so far with the last assistant message's content replaced by a marker, and the same followed by
the observation with the next assistant turn opened. The second must extend the first (else
ValueError: the template rewrites earlier turns once later ones follow, as templates that drop
past reasoning do, and no ids can be spliced). What follows the marker in the first rendering is
the template's end of the assistant turn (`<|im_end|>\\n` in ChatML); what the second adds is
the observation's turns and the next turn's opening. The model's turn ended on a special token
(its EOS) that the end of turn holds: that much of the end of turn is the model's and is left
out, the rest (`\\n`) is the observation's. A turn that ended otherwise (max tokens, a stop
string) gets the whole end of turn. The text is tokenized alone; it starts right after a
special token, where the whole conversation's tokenization also starts afresh, so the ids are
those `apply_chat_template` gives the whole conversation. The concatenation differs from it:
where the model sampled other ids than the tokenizer would give its text (decoding is the
same); after the last turn, which has no end of turn (nothing follows it); where the template
puts text between the content and the special token (`\\n<|im_end|>`), which the model did not
write; and where an observation's content holds a special token's text, which is broken up by a
zero-width space here so that no tool output or echoed text can forge a turn boundary.

Tools reach the model through the template's `tools=` where the template renders them
("template" style); a template that does not (the tiny model's and SmolLM2's) gets the
"fallback" style: the tools listed in a system message in the parser's convention, and each run
of tool messages rendered as one user turn of `<tool_response>` blocks (rlvr.envs.parsers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlvr.envs.parsers import ToolCallParser, get_parser

__all__ = ["STYLES", "ChatRenderer", "check_append_only", "template_style"]

STYLES = ("auto", "template", "fallback")
_MARKER = "<<rlvr: assistant content>>"
_PROBE_TOOL = "rlvr_probe_tool"
_PROBE_RESULT = "rlvr probe result"
_ZERO_WIDTH_SPACE = "\u200b"
PROBE_SCHEMA = {
    "type": "function",
    "function": {
        "name": _PROBE_TOOL,
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {}},
    },
}
"""A tool's schema for probing what a template renders."""


def template_style(tokenizer: Any) -> str:
    """ "template" when the tokenizer's chat template renders `tools=` and `tool` messages,
    else "fallback"."""
    probe = PROBE_SCHEMA
    user = {"role": "user", "content": "hello"}
    try:
        with_tools = tokenizer.apply_chat_template([user], tools=[probe], tokenize=False)
        with_result = tokenizer.apply_chat_template(
            [
                user,
                {"role": "assistant", "content": "calling"},
                {"role": "tool", "name": _PROBE_TOOL, "content": _PROBE_RESULT},
            ],
            tokenize=False,
        )
    except Exception:  # a template that raises on a tool message
        return "fallback"
    return "template" if _PROBE_TOOL in with_tools and _PROBE_RESULT in with_result else "fallback"


class ChatRenderer:
    """Renders conversations of canonical messages (`role`, `content`, a tool message's `name`)
    for one tokenizer, one set of tool schemas and one tool-call parser; `style` is "template",
    "fallback" or "auto" (`template_style`)."""

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[dict[str, Any]] = (),
        parser: ToolCallParser | str = "hermes",
        style: str = "auto",
    ):
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {tokenizer.name_or_path or 'this model'} has no chat "
                "template: multi-turn rollouts render their turns through one"
            )
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.parser = get_parser(parser) if isinstance(parser, str) else parser
        self.style = template_style(tokenizer) if style == "auto" else style
        added = tokenizer.added_tokens_decoder
        self._special_ids = {i for i, t in added.items() if t.special} | set(
            tokenizer.all_special_ids
        )
        texts = {t.content for t in added.values() if t.special} | set(tokenizer.all_special_tokens)
        self._special_texts = sorted((t for t in texts if len(t) > 1), key=len, reverse=True)

    def template_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages the template gets: as they are ("template"), or with the tools announced
        in the system message and each run of tool messages made one user turn ("fallback")."""
        if self.style == "template":
            return [dict(m) for m in messages]
        out: list[dict[str, Any]] = []
        results: list[str] = []
        for message in [*messages, None]:
            if message is not None and message["role"] == "tool":
                results.append(message["content"])
                continue
            if results:
                out.append({"role": "user", "content": self.parser.results_text(results)})
                results = []
            if message is not None:
                out.append(dict(message))
        if self.tools:
            listing = self.parser.system_prompt(self.tools)
            if out and out[0]["role"] == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{listing}"
            else:
                out.insert(0, {"role": "system", "content": listing})
        return out

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The conversation as the template writes it (text)."""
        tools = {"tools": self.tools} if self.tools and self.style == "template" else {}
        return self.tokenizer.apply_chat_template(
            self.template_messages(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **tools,
        )

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text, special tokens written in it included (as the template's own
        tokenization does), no BOS or other added tokens."""
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def prompt_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The first turn's prompt: the messages with the assistant's turn opened."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def _defuse(self, text: str) -> str:
        """`text` with every special token's text broken up, so it tokenizes as plain text."""
        for special in self._special_texts:
            if special in text:
                text = text.replace(special, special[0] + _ZERO_WIDTH_SPACE + special[1:])
        return text

    def splice_text(
        self, conversation: Sequence[dict[str, Any]], observation: Sequence[dict[str, Any]]
    ) -> tuple[str, str]:
        """(the template's end of the last assistant turn, the observation's turns and the next
        turn's opening) as text; `conversation` ends with that assistant message."""
        *earlier, last = conversation
        if last["role"] != "assistant":
            raise ValueError("the conversation must end with the assistant's message")
        base = [*earlier, {**last, "content": _MARKER}]
        shown = [{**m, "content": self._defuse(m["content"])} for m in observation]
        before = self.render(base, add_generation_prompt=False)
        after = self.render([*base, *shown], add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template renders the earlier turns differently once an observation "
                "follows them, so the model's sampled ids cannot be kept: multi-turn rollouts "
                "need a template that only appends"
            )
        return before[before.rindex(_MARKER) + len(_MARKER) :], after[len(before) :]

    def observation_ids(
        self,
        conversation: Sequence[dict[str, Any]],
        completion_ids: Sequence[int],
        observation: Sequence[dict[str, Any]],
    ) -> list[int]:
        """The ids that follow the model's `completion_ids` (the turn that wrote the last
        message of `conversation`) before its next turn: the rest of the assistant turn's end,
        the observation's messages, the next assistant turn's opening."""
        turn_end, rest = self.splice_text(conversation, observation)
        if completion_ids and int(completion_ids[-1]) in self._special_ids:
            sampled = self.tokenizer.convert_ids_to_tokens(int(completion_ids[-1]))
            at = turn_end.find(sampled)
            if at >= 0:
                turn_end = turn_end[at + len(sampled) :]
        return self.encode(turn_end + rest)


def check_append_only(renderer: ChatRenderer) -> None:
    """ValueError unless the renderer's template renders a synthetic multi-turn conversation
    (system, user, then assistant turns with reasoning and a tool call, answered by a tool
    result and by a user message) append-only: the rendering after each message (with the
    assistant's turn opened where one follows), as text and as token ids, extends the previous
    one. Run once before any rollout, so that a template that
    rewrites earlier turns fails at load instead of in every trajectory's second turn."""
    call = renderer.parser.write_call(_PROBE_TOOL, {})
    conversation = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": f"<think>The tool knows.</think>\n{call}"},
        {"role": "tool", "name": _PROBE_TOOL, "content": _PROBE_RESULT},
        {"role": "assistant", "content": "<think>It says so.</think>\nIt is 42."},
        {"role": "user", "content": "Are you sure?"},
        {"role": "assistant", "content": "<think>Yes.</think>\n\\boxed{42}"},
    ]
    previous: tuple[int, str, list[int]] | None = None
    for end in range(2, len(conversation) + 1):
        opens_turn = end < len(conversation) and conversation[end]["role"] == "assistant"
        text = renderer.render(conversation[:end], add_generation_prompt=opens_turn)
        ids = renderer.encode(text)
        if previous is not None:
            last, before, before_ids = previous
            if not text.startswith(before) or ids[: len(before_ids)] != before_ids:
                raise ValueError(
                    f"rendering messages 0..{end - 1} of a multi-turn conversation does not "
                    f"extend rendering messages 0..{last - 1} (their "
                    f"{'token ids' if text.startswith(before) else 'texts'} differ): the template "
                    "rewrites earlier turns once later ones follow, so the model's sampled ids "
                    "cannot be kept; multi-turn rollouts need a template that only appends"
                )
        previous = (end, text, ids)
