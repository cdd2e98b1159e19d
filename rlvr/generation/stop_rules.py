"""How a backend consults a per-sample `StopRule`, shared so both engines stop at the same token.

DUET's marker-gated abort (arXiv:2605.08441, Eq. 5) runs inside generation: after every produced
token the rule sees the response so far and may force EOS as the next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlvr.generation.base import StopRule

FORCED_EOS = "forced_eos_at"
"""`Sample.flags` key: the index in the response of the EOS a stop rule forced (absent when none
was): no distribution drew it, so the trainer's engine importance weight leaves it out."""


class StopRuleTracker:
    """Feeds one sample's response tokens to its `StopRule`, each token exactly once, in order.

    Engines observe the growing response at their own pace (vLLM once per scheduling step, possibly
    several tokens behind after a preemption), so the tracker remembers how many tokens the rule has
    seen and replays the missing prefixes. Once the rule asks to stop the decision is latched: the
    rule is not consulted again, so its flags describe the moment it fired.
    """

    def __init__(self, rule: StopRule, eos_token_id: int) -> None:
        self.rule = rule
        self.eos_token_id = eos_token_id
        self.seen = 0
        self.fired = False

    def observe(self, response_ids: Sequence[int], length: int | None = None) -> bool:
        """Show the rule every token of `response_ids[:length]` it has not seen; True once it fired.

        `response_ids` may be the engine's live list (no copy is made in the common case of one new
        token); `length` excludes trailing entries that are not real tokens yet.
        """
        length = len(response_ids) if length is None else length
        while not self.fired and self.seen < length:
            self.seen += 1
            prefix = response_ids if self.seen == len(response_ids) else response_ids[: self.seen]
            self.fired = bool(self.rule.should_stop(prefix))
        return self.fired

    def flags(self, response_length: int) -> dict[str, Any]:
        """The rule's own report (e.g. DUET's marker / eps_kept / aborted) and, when a token
        followed its firing (the forced EOS; none when max_tokens came first), `FORCED_EOS`."""
        flags = dict(self.rule.flags())
        if self.fired and self.seen < response_length:
            flags[FORCED_EOS] = self.seen
        return flags
