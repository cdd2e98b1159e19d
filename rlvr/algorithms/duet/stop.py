"""DUET's in-generation stop rule (arXiv:2605.08441, Sec. 3.2, Eq. 5, Alg. 1 lines 11-33): answer-
marker detection on decoded text, and the per-rollout controller that trims, keeps or aborts a
rollout. The marker patterns follow the authors' code ("the reference code",
github.com/Haoyu-Hu/DUET), which is looser than App. A.3's wording: any closed box counts,
whatever follows it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlvr.algorithms.counter_rng import splitmix64, unit_float
from rlvr.answers import matched_group

MARKER_DOMAINS = ("math", "code", "qa")

_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
_MATH_PATTERNS = [
    re.compile(r"\\boxed\[[^\[\]]*\]"),
    re.compile(r"##\s*Final\s+Answer", re.IGNORECASE),
    re.compile(r"Final\s+answer\s*[:=]\s*\S", re.IGNORECASE),
]
_GENERIC_PATTERNS = [
    re.compile(r"<answer>[\s\S]*?</answer>"),
    re.compile(r"<final_answer>[\s\S]*?</final_answer>"),
    # The paper writes "Therefore the answer is X", the reference code requires the comma.
    re.compile(r"(?:^|\s)Therefore,?\s+the\s+answer\s+is\s+\S", re.IGNORECASE),
]
# A fence line at column 0: three backticks, an optional language tag, nothing else.
_FENCE_LINE = re.compile(r"^```([^\s`]*)[ \t]*$", re.MULTILINE)


def _has_closed_boxed(text: str) -> bool:
    r"""True if some `\boxed{` has its matching `}` (any nesting depth).

    LaTeX escapes (`\{`, `\}`, `\\`) are skipped as pairs, so `\boxed{\{1,2\}}` is closed while
    `\boxed{\left\{ x` is not. The reference regex allows only two nesting levels; the answer
    extractor's brace scanner accepts every depth (e.g. `\boxed{\frac{\sqrt{a^{2}}}{b}}`).
    """
    return any(matched_group(text, m.end() - 1) is not None for m in _BOXED_OPEN.finditer(text))


def _has_closing_fence(text: str) -> bool:
    """True if the text closes a code fence.

    A tagged fence (```python) opens a block; a bare fence closes the open block. A bare fence
    with no fence before it closes the block the prompt template opened (the paper's code
    wrapper), unless nothing but whitespace precedes it, in which case it opens a block.
    """
    is_open = False
    for match in _FENCE_LINE.finditer(text):
        if match.group(1):
            is_open = True
        elif is_open or text[: match.start()].strip():
            return True
        else:
            is_open = True
    return False


def has_marker(text: str, domain: str) -> bool:
    r"""Whether decoded rollout text carries the domain's answer marker m (Sec. 3.2, App. A.3).

    math: a closed `\boxed{...}` (nested braces), `\boxed[...]`, "## Final Answer" or
    "Final answer: X". code: a closing ``` fence at column 0. qa: `<answer>...</answer>`,
    `<final_answer>...</final_answer>` or "Therefore, the answer is X". The qa forms count in
    every domain. Callers pass the decoded last 256 tokens (`StopController` does).
    """
    if domain not in MARKER_DOMAINS:
        raise ValueError(f"unknown marker domain {domain!r}; choose one of {MARKER_DOMAINS}")
    if any(p.search(text) for p in _GENERIC_PATTERNS):
        return True
    if domain == "math":
        return _has_closed_boxed(text) or any(p.search(text) for p in _MATH_PATTERNS)
    if domain == "code":
        return _has_closing_fence(text)
    return False


def rollout_seed(base_seed: int, step: int, row: int) -> int:
    """Seed of one rollout's eps-keep coin: a 64-bit hash of (base seed, training step, row).

    Rows of one step and the same row across steps get independent coins; the same triple
    reproduces the decision on any machine.
    """
    key = f"{base_seed}:{step}:{row}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def coin(seed: int) -> float:
    """Uniform [0, 1) value of a seed: SplitMix64's output mix, top 53 bits.

    A pure function of the seed (no generator object), cheap enough to run once per rollout
    inside the engine's sampling step.
    """
    return unit_float(splitmix64(seed))


class StopController:
    """One rollout's marker-gated stop rule (Eq. 5); implements `rlvr.generation.base.StopRule`.

    Driven token by token: `should_stop(ids)` receives all response ids so far (t = len(ids),
    called for t = 1, 2, ... before the next token is sampled) and returns True when the next
    token must be EOS. From t >= k1, at every t divisible by `poll_every`, the decoded last
    `window` tokens are checked for the domain marker; once it fires at t_m, EOS is forced at
    t = t_m + grace (tail trim; the rollout is kept with propensity 1). The paper may stop
    earlier, at a low-entropy token past the marker (Alg. 1 line 20); we use the cap alone. At
    t = k2 + grace without a marker the text is checked once more (as the reference code does);
    if still none, one coin U = coin(seed) in [0, 1) is drawn: U < eps_abort keeps the rollout
    (eps_kept, propensity eps_abort) and runs it to natural EOS / max_tokens with no further
    checks; otherwise EOS is forced now (aborted). A rollout that ends naturally before any
    decision has all flags False. Once it asks to stop it keeps answering True, and is never
    consulted again by `StopRuleTracker`.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        *,
        k1: int,
        k2: int,
        seed: int,
        domain: str = "math",
        grace: int = 150,
        eps_abort: float = 0.05,
        poll_every: int = 8,
        window: int = 256,
    ) -> None:
        """`decode` turns token ids into text: `tokenizer.decode(ids, skip_special_tokens=True)`
        in the engines, as the reference code decodes the marker window."""
        if domain not in MARKER_DOMAINS:
            raise ValueError(f"unknown marker domain {domain!r}; choose one of {MARKER_DOMAINS}")
        if not 0.0 <= eps_abort <= 1.0:
            raise ValueError(f"eps_abort must be in [0, 1], got {eps_abort}")
        if poll_every < 1 or window < 1 or grace < 0:
            raise ValueError("poll_every and window must be >= 1 and grace >= 0")
        self.decode = decode
        self.k1 = k1
        self.k2 = k2
        self.seed = seed
        self.domain = domain
        self.grace = grace
        self.eps_abort = eps_abort
        self.poll_every = poll_every
        self.window = window
        self.marker_at: int | None = None
        self.stop_at: int | None = None
        self.eps_kept = False
        self.aborted = False

    def _sees_marker(self, ids: Sequence[int]) -> bool:
        return has_marker(self.decode(ids[-self.window :]), self.domain)

    def should_stop(self, generated_ids: Sequence[int]) -> bool:
        """Advance the rule to t = len(generated_ids); True forces EOS as the next token."""
        if self.stop_at is not None:
            return True
        if self.eps_kept:
            return False
        t = len(generated_ids)
        if self.marker_at is None:
            polled = t >= self.k1 and t % self.poll_every == 0
            at_gate = t >= self.k2 + self.grace
            if (polled or at_gate) and self._sees_marker(generated_ids):
                self.marker_at = t
            elif at_gate:
                if coin(self.seed) < self.eps_abort:
                    self.eps_kept = True
                    return False
                self.aborted = True
                self.stop_at = t
                return True
        if self.marker_at is not None and t >= self.marker_at + self.grace:
            self.stop_at = t
            return True
        return False

    def flags(self) -> dict[str, Any]:
        """marker / eps_kept / aborted, and marker_at / stop_at (token counts, None if unset).

        stop_at is the response length when EOS was forced (the EOS is token stop_at + 1).
        """
        return {
            "marker": self.marker_at is not None,
            "eps_kept": self.eps_kept,
            "aborted": self.aborted,
            "marker_at": self.marker_at,
            "stop_at": self.stop_at,
        }


@dataclass(frozen=True)
class StopControllerFactory:
    """`StopRuleFactory` for one training step: a fresh `StopController` per rollout.

    `request_sizes[i]` is the number of samples of request i (n_q when requests carry n = n_q,
    all ones when every rollout is its own request); the rollout row is the flat index
    first_row + sum(request_sizes[:i]) + j, and its coin seed is `rollout_seed(base_seed, step,
    row)`. `first_row` is the step-wide row of this engine's first rollout, so a step split over
    several engines draws the coins one engine would.
    """

    decode: Callable[[Sequence[int]], str]
    request_sizes: Sequence[int]
    k1: int
    k2: int
    base_seed: int
    step: int
    domain: str = "math"
    grace: int = 150
    eps_abort: float = 0.05
    poll_every: int = 8
    window: int = 256
    first_row: int = 0

    def __call__(self, request_index: int, sample_index: int) -> StopController:
        """The controller of sample `sample_index` of request `request_index`."""
        if not 0 <= sample_index < self.request_sizes[request_index]:
            raise IndexError(
                f"sample {sample_index} outside request {request_index} "
                f"of size {self.request_sizes[request_index]}"
            )
        row = self.first_row + sum(self.request_sizes[:request_index]) + sample_index
        return StopController(
            self.decode,
            k1=self.k1,
            k2=self.k2,
            seed=rollout_seed(self.base_seed, self.step, row),
            domain=self.domain,
            grace=self.grace,
            eps_abort=self.eps_abort,
            poll_every=self.poll_every,
            window=self.window,
        )
