"""How far a generation engine's sampled-token log-probs are from the trainer's for the same tokens.

The engine samples rollouts and reports log mu(token) under the distribution it drew from (the
tempered softmax truncated to its top-p nucleus); the trainer recomputes log pi_old(token) with its
own kernels under the same truncation (`token_logprobs` at the sampling temperature, less
`token_nucleus_log_mass`). Their gap is what the engine importance correction
(`grpo.engine_is_weights`) repairs; this module measures it on a batch of generation results, for
tests and `bench/`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlvr.algorithms.grpo import engine_is_weights
from rlvr.generation.base import GenerationResult
from rlvr.generation.stop_rules import FORCED_EOS
from rlvr.training.batch import TrainBatch, build_batch, token_logprobs, token_nucleus_log_mass


def results_batch(results: Sequence[GenerationResult], pad_id: int) -> TrainBatch:
    """Every sample of `results` as a batch row, carrying the engine's log-probs."""
    samples = [(r.prompt_ids, s) for r in results for s in r.samples]
    return build_batch(
        [list(p) for p, _ in samples],
        [s.token_ids for _, s in samples],
        pad_id,
        rollout_logprobs=[s.logprobs for _, s in samples],
        forced_eos=[s.flags.get(FORCED_EOS) for _, s in samples],
    )


@torch.no_grad()
def trainer_logprobs(
    model: Callable[..., Any],
    batch: TrainBatch,
    temperature: float,
    top_p: float = 1.0,
    micro_batch_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of a plain HF model over `batch` at `temperature` (``[B, T]``, CPU),
    within the top-p nucleus when ``top_p`` < 1, as the trainer's forward computes them; and the
    response tokens outside that nucleus (``[B, T]`` bool; None when ``top_p`` is 1)."""
    out = torch.zeros(batch.input_ids.shape)
    outside = torch.zeros(batch.input_ids.shape, dtype=torch.bool) if top_p < 1.0 else None
    for start in range(0, len(batch), micro_batch_size):
        mb = batch.micro_batch(start, min(start + micro_batch_size, len(batch)))
        rows, width = slice(start, start + len(mb)), mb.input_ids.shape[1]
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        logp = token_logprobs(logits, mb.input_ids, temperature)
        if outside is not None:
            log_mass, outside[rows, :width] = token_nucleus_log_mass(
                logits, mb.input_ids, mb.response_mask, temperature, top_p
            )
            logp = logp - log_mass
        out[rows, :width] = logp
    return out, outside


def mismatch(
    batch: TrainBatch, logp: torch.Tensor, outside: torch.Tensor | None = None, cap: float = 2.0
) -> dict[str, float]:
    """The engine/trainer ratio statistics of `grpo.engine_is_weights` (``outside``: the tokens
    outside pi_old's nucleus, from `trainer_logprobs`) plus the largest absolute log-prob
    difference, over the sampled response tokens whose trainer log-prob is defined (inside)."""
    _, stats = engine_is_weights(
        logp, batch.rollout_logp, batch.response_mask, "tis", cap, outside, batch.forced
    )
    compared = batch.response_mask if batch.forced is None else batch.response_mask & ~batch.forced
    if outside is not None:
        compared = compared & ~outside
    diff = (logp - batch.rollout_logp).abs()
    out = {key: float(value) for key, value in stats.items()}
    out["max_abs_logp_diff"] = float(torch.where(compared, diff, 0.0).max())
    return out


class MismatchTally:
    """Running means (and the max) of `grpo.engine_is_weights`'s statistics over the
    micro-batches of an update, each weighted by the tokens it is a mean over: the compared
    tokens, or for engine_kl those inside pi_old's nucleus."""

    MEANS = {
        "engine_ratio_mean": "engine_tokens",
        "engine_capped_frac": "engine_tokens",
        "engine_kl": "engine_inside_tokens",
        "engine_outside_frac": "engine_tokens",
    }
    COUNTS = ("engine_tokens", "engine_inside_tokens")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.MEANS, 0.0)
        self.counts = dict.fromkeys(self.COUNTS, 0.0)
        self.ratio_max = 0.0

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        for key, count in self.MEANS.items():
            self.sums[key] += float(stats[key]) * float(stats[count])
        for count in self.COUNTS:
            self.counts[count] += float(stats[count])
        if float(stats["engine_tokens"]):
            self.ratio_max = max(self.ratio_max, float(stats["engine_ratio_max"]))

    def summary(self, all_reduce: Callable[..., list[float]]) -> dict[str, float]:
        reduced = all_reduce([*self.sums.values(), *self.counts.values()], "sum")
        sums = dict(zip(self.MEANS, reduced[: len(self.MEANS)], strict=True))
        counts = dict(zip(self.COUNTS, reduced[len(self.MEANS) :], strict=True))
        (ratio_max,) = all_reduce([self.ratio_max], "max")
        out = {
            key: sums[key] / counts[count] if counts[count] else 0.0
            for key, count in self.MEANS.items()
        }
        out["engine_ratio_max"] = ratio_max if counts["engine_tokens"] else 1.0
        return out
