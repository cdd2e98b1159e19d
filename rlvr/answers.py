"""Final-answer extraction from model responses: the last `\\boxed{}`/`\\fbox{}`, else an answer line.

Linear-time scans only (no backtracking regex over the whole response), so a megabyte of model
output costs milliseconds in the caller's process before anything reaches a verifier worker.
"""

from __future__ import annotations

import re
from collections import deque

# Not followed by a letter: \fboxsep and the like are other macros.
_BOX_MACRO = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# An escape (`\{`, `\}`, `\\`) is consumed as one token so escaped braces never count as grouping.
_GROUP_TOKENS = re.compile(r"\\.|[{}]", re.DOTALL)
_ANSWER_LINE = re.compile(
    r"####[ \t]*(?P<hash>[^\n]*)"
    r"|answer[*_]*[ \t]*(?:is\b|:|=)[ \t*_]*(?P<said>[^\n]*)",
    re.IGNORECASE,
)
_STRIP_EDGES = " \t*_"


def matched_group(text: str, open_pos: int) -> str | None:
    """Content of the brace group opening at `text[open_pos] == "{"`; None when it never closes.

    The one brace-counting scan for boxed answers (nesting at any depth; `\\{`, `\\}` and `\\\\`
    skipped as pairs), shared by answer extraction and DUET's answer-marker check.
    """
    depth = 0
    for token in _GROUP_TOKENS.finditer(text, open_pos):
        brace = token.group()
        if brace == "{":
            depth += 1
        elif brace == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : token.start()]
    return None


def _last_macro_end(text: str) -> int | None:
    """Index just past the last `\\boxed`/`\\fbox` macro name in `text`, None if there is none."""
    last = deque(_BOX_MACRO.finditer(text), maxlen=1)
    return last[0].end() if last else None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed`/`\\fbox` in `text`; None if there is none or it is malformed.

    `\\boxed{...}` is matched by a brace-counting scan (nested and escaped braces handled);
    `\\boxed 5` (no braces) takes the text up to the next whitespace or `$`. Only the last macro
    counts: if it is unclosed (a truncated response) or empty, the result is None rather than
    an earlier answer the model moved on from.
    """
    after = _last_macro_end(text)
    if after is None:
        return None
    arg_start = len(text) - len(text[after:].lstrip())
    if text.startswith("{", arg_start):
        content = matched_group(text, arg_start)
    else:
        content = re.match(r"[^\s$]*", text[arg_start:]).group().rstrip(".,")
    if content is None or not content.strip():
        return None
    return content.strip()


def _clean_answer_line(answer: str) -> str | None:
    # An answer line often goes on as prose ("42. This is because..."): keep the first sentence.
    answer = answer.split(". ", 1)[0]
    previous = None
    while answer != previous:
        previous = answer
        answer = answer.strip(_STRIP_EDGES).rstrip(".")
        if len(answer) >= 2 and answer[0] == answer[-1] == "$":
            answer = answer[1:-1]
        if answer.startswith("\\(") and answer.endswith("\\)"):
            answer = answer[2:-2]
    return answer or None


def final_answer_line(text: str) -> str | None:
    """The answer on the last answer line: `#### 42`, `The answer is 42`, `Final answer: $42$`."""
    last = deque(_ANSWER_LINE.finditer(text), maxlen=1)
    if not last:
        return None
    match = last[0]
    return _clean_answer_line(
        match.group("hash") if match.group("hash") is not None else match.group("said")
    )


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the last boxed answer, else the last answer line, else None.

    A response that contains a boxed macro is judged on it alone (see `last_boxed`); answer
    lines are the fallback for responses that never box anything (GSM8K `####` style).
    """
    if _last_macro_end(response) is not None:
        return last_boxed(response)
    return final_answer_line(response)
