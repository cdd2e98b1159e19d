"""What both generation backends need for Tandem co-generation (arXiv:2606.28166, Sec. 3.3): a
per-sample author tracker, token draws by the tandem module's seeding contract, the vocabulary
check at start, and the counters a tandem sample reports.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from rlvr.algorithms.nucleus import top_p_filter
from rlvr.algorithms.tandem import (
    GREEDY_EPS,
    SwitchCounters,
    WordSwitchSchedule,
    require_same_vocab,
)

TANDEM_FLAGS = "tandem"
"""Key of a tandem sample's counters in `Sample.flags`."""


class AuthorTracker:
    """One tandem sample: its author state machine, fed the response as the engine produces it,
    and what its tokens are drawn with (`draw_tokens`): its own CPU generator seeded with the
    sample's seed and its sampling settings.

    The engine shows it the growing response at its own pace (vLLM once per scheduling step, and
    again after a preemption), so it remembers how many tokens it has observed.
    """

    def __init__(
        self, schedule: WordSwitchSchedule, seed: int, temperature: float, top_p: float
    ) -> None:
        self.state = schedule.start(seed)
        self.temperature = temperature
        self.top_p = top_p
        self.generator = torch.Generator("cpu").manual_seed(seed)
        self.authorship: list[int] = []
        self.logprobs: list[float] = []
        """Log-prob of each drawn token under its author's processed distribution, kept by an
        engine whose own sampler leaves the draws to `draw_tokens` (vLLM on CPU)."""

    @classmethod
    def resume(
        cls,
        schedule: WordSwitchSchedule,
        seed: int,
        temperature: float,
        top_p: float,
        response_ids: Sequence[int],
        generator_state: torch.Tensor | None,
    ) -> AuthorTracker:
        """The tracker of a sample whose `response_ids` another engine wrote: its author state
        replayed from the ids, its token generator set to `generator_state` (the state after the
        last draw; None: no draw yet, the freshly seeded generator)."""
        tracker = cls(schedule, seed, temperature, top_p)
        tracker.observe(response_ids)
        if generator_state is not None:
            tracker.generator.set_state(generator_state)
        return tracker

    def observe(
        self, response_ids: Sequence[int], length: int | None = None, offset: int = 0
    ) -> int:
        """Feed the tokens of `response_ids[:length]` not seen yet; return the next token's author.
        `offset`: the response tokens before `response_ids[0]` (already seen: a segment of a
        response another engine began)."""
        length = len(response_ids) if length is None else length
        for token in response_ids[len(self.authorship) - offset : length]:
            self.authorship.append(self.state.observe(token))
        return self.state.author

    def finish(self, response_ids: Sequence[int]) -> list[int]:
        """The authorship of the whole response (the last token is seen here for the first time)."""
        self.observe(response_ids)
        if len(self.authorship) != len(response_ids):
            raise RuntimeError(
                f"authorship has {len(self.authorship)} flags for {len(response_ids)} tokens"
            )
        return list(self.authorship)

    def flags(self) -> dict[str, Any]:
        """`Sample.flags` entry: {"tandem": counters}, redraws included."""
        return {TANDEM_FLAGS: counters_to_dict(self.state.counters)}


def draw_tokens(
    logits: torch.Tensor, trackers: Sequence[AuthorTracker]
) -> tuple[list[int], list[float]]:
    """Row i of `logits` `[rows, vocab]` sampled for `trackers[i]`: its token and that token's
    log-prob under the processed distribution (temperature, then top-p; raw when greedy).

    Each row's token is exactly `rlvr.algorithms.tandem.sample_token(row, its generator, T,
    top_p)`, the seeding contract, computed for all rows of one setting at once: the same float32
    filters row-wise and one `exponential_` over the full row from each row's own generator.
    """
    logits = logits.detach().float().cpu()
    tokens = [0] * len(trackers)
    logprobs = [0.0] * len(trackers)
    settings: dict[tuple[float, float], list[int]] = {}
    for row, tracker in enumerate(trackers):
        settings.setdefault((tracker.temperature, tracker.top_p), []).append(row)
    for (temperature, top_p), rows in settings.items():
        group = logits[rows]
        if temperature < GREEDY_EPS:
            chosen = group.argmax(dim=-1)
        else:
            group = top_p_filter(group / temperature, top_p)
            probs = group.softmax(dim=-1)
            noise = torch.empty_like(probs)
            for i, row in enumerate(rows):
                noise[i].exponential_(generator=trackers[row].generator)
            chosen = (probs / noise).argmax(dim=-1)
        picked = group.log_softmax(dim=-1).gather(1, chosen[:, None])[:, 0]
        for row, token, logprob in zip(rows, chosen.tolist(), picked.tolist(), strict=True):
            tokens[row], logprobs[row] = token, logprob
    return tokens, logprobs


def counters_to_dict(counters: SwitchCounters) -> dict[str, int]:
    """Plain-dict form of a rollout's schedule counters (it crosses actors and goes to logs)."""
    return {**asdict(counters), "redraws": counters.redraws}


def counters_from_flags(flags: dict[str, Any]) -> SwitchCounters:
    """The counters a tandem sample carries in its flags; raises when they are missing."""
    if TANDEM_FLAGS not in flags:
        raise ValueError("sample has no tandem counters: it was not generated in tandem mode")
    c = flags[TANDEM_FLAGS]
    return SwitchCounters(c["boundary_redraws"], c["cap_redraws"], c["switches"])


def tandem_seed(seed: int | None) -> int:
    """The seed of a tandem sample: its own, else a fresh random one.

    Coins and tokens both come from it, so an unseeded request still gets a reproducible pair.
    """
    return random.SystemRandom().getrandbits(63) if seed is None else seed


def check_same_tokenizer(senior_path: str | Path, junior_path: str | Path) -> None:
    """Refuse a junior whose tokenizer differs from the senior's: handoff passes token ids."""
    senior_vocab = AutoTokenizer.from_pretrained(senior_path).get_vocab()
    junior_vocab = AutoTokenizer.from_pretrained(junior_path).get_vocab()
    try:
        require_same_vocab(senior_vocab, junior_vocab)
    except ValueError as err:
        raise ValueError(f"junior {junior_path}: {err}") from None
