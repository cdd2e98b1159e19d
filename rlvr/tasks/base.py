"""Task types: a verifiable problem with a stable id, a prompt (text or chat turns), a gold answer
and a reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One verifiable problem. `id` is stable across runs (used to key per-prompt state)."""

    id: str
    prompt: str
    answer: str
    """Gold final answer, as text (compared by the math verifier)."""
    solution: str = ""
    """Reference solution ending in \\boxed{answer}; used for SFT warm-up and DRO references."""
    reference: str = ""
    """Reference final answer for reference-based rewards (DRO): the text teacher-forced after a
    rollout's CoT. Empty: the tail of `solution` after the configured CoT/answer delimiter."""
    messages: tuple[tuple[str, str], ...] = ()
    """A prompt given as chat turns, (role, content) pairs ending in the user's turn, whose text
    is then `prompt`; rendered through the chat template with the instruction in that last turn.
    Empty: `prompt` is the single user turn."""
    metadata: tuple[tuple[str, Any], ...] = ()
    """Extra per-problem data, (key, value) pairs in the file's column order (a tuple keeps the
    frozen problem picklable); reward plug-ins get it as a dict (`dict(problem.metadata)`)."""
