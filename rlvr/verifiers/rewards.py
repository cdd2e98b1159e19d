"""Example reward functions for `verifier.kind: python` (and `verifier.rewards` entries).

Each has the plug-in signature `fn(prompts, responses, golds, metadata)` and returns one entry per
response: `boxed_format` (1.0 when the response ends with its `\\boxed{...}` answer) and
`keyword_coverage` (the share of the problem's `metadata["keywords"]` the response mentions).
`format_reward(pattern)` builds a format reward for another pattern, to name from a module of
one's own (`my_rewards.py`: `ends_with_answer = format_reward(r"Answer: .+\\Z")`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["BOXED_AT_END", "boxed_format", "format_reward", "keyword_coverage"]

BOXED_AT_END = r"\\boxed\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}[\s.$]*\Z"
"""A `\\boxed{...}` (braces nested up to three deep) with nothing after it but spaces, a full stop
or closing `$`."""

RewardFn = Callable[[list[str], list[str], list[str], list[dict]], list]


def format_reward(pattern: str) -> RewardFn:
    """A reward function scoring 1.0 for a response in which `pattern` matches (re.search), else
    0.0; status "correct" or "wrong"."""
    compiled = re.compile(pattern)

    def reward(
        prompts: list[str], responses: list[str], golds: list[str], metadata: list[dict]
    ) -> list[float]:
        return [1.0 if compiled.search(r) else 0.0 for r in responses]

    return reward


boxed_format = format_reward(BOXED_AT_END)
"""1.0 when a response ends with a `\\boxed{...}` answer (`BOXED_AT_END`), else 0.0."""


def keyword_coverage(
    prompts: list[str], responses: list[str], golds: list[str], metadata: list[dict]
) -> list[tuple[float, str]]:
    """The share of a problem's `metadata["keywords"]` (a list of strings, or one string) found in
    its response, case-insensitively; status "correct" when all are, "wrong" otherwise, and
    (0.0, "no_keywords") for a problem that lists none."""
    out: list[tuple[float, str]] = []
    for response, meta in zip(responses, metadata, strict=True):
        keywords = meta.get("keywords") or []
        keywords = [keywords] if isinstance(keywords, str) else list(keywords)
        if not keywords:
            out.append((0.0, "no_keywords"))
            continue
        text = response.lower()
        found = sum(str(k).lower() in text for k in keywords)
        out.append((found / len(keywords), "correct" if found == len(keywords) else "wrong"))
    return out
