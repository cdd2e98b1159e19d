"""Top-p (nucleus) truncation as vLLM applies it (Holtzman et al., arXiv:1904.09751): the rule the
engines sample with, shared by the samplers that mirror them and by the trainer's importance
weights, which must compare the engine's truncated log-probs with the same truncation of pi_old.

A token is dropped when the mass of the tokens more likely than it already reaches top_p, so the
nucleus is the smallest set of most likely tokens whose mass reaches top_p, never empty.
"""

from __future__ import annotations

import torch

FIRST_K = 64
"""Candidates `nucleus_floor` looks at first: enough for most positions of a trained model."""


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` ``[..., vocab]`` (already divided by the temperature) with every token outside
    the top-p nucleus set to -inf: vLLM's native sort-based filter, tie order included."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
    drop[..., -1] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest probability the top-p nucleus keeps in each row of ``probs`` ``[N, vocab]``
    (``[N]``): the nucleus is every token at or above it.

    Rows are decided from their `FIRST_K` most likely tokens, then 16 times as many, then whole:
    a trained model's nucleus is mostly small, and a partial top-k costs a fraction of a sort.
    """
    vocab = probs.shape[-1]
    floor = torch.empty(len(probs), dtype=probs.dtype, device=probs.device)
    rows = torch.arange(len(probs), device=probs.device)
    k = FIRST_K
    while len(rows):
        k = min(k, vocab)
        row_floor, undecided = _floor_of_sorted(probs[rows].topk(k, dim=-1).values, top_p)
        if k == vocab:
            undecided[:] = False
        floor[rows[~undecided]] = row_floor[~undecided]
        rows = rows[undecided]
        k *= 16
    return floor


def _floor_of_sorted(desc: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(floor, every candidate kept) from each row's most likely probabilities in descending
    order: a token is kept while the mass above it is below top_p."""
    kept = (desc.cumsum(dim=-1) - desc) < top_p
    count = kept.sum(dim=-1)
    return desc.gather(-1, (count - 1)[:, None]).squeeze(-1), count == desc.shape[-1]


def nucleus_log_mass(
    logits: torch.Tensor, targets: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` ``[N, vocab]`` (divided by the temperature): the log of the nucleus'
    probability mass, and whether ``targets`` ``[N]`` lies outside the nucleus (``[N]`` bool).

    log p(target) - log mass is the target's log-prob under the truncated, renormalised
    distribution. A target outside the nucleus (a token the engine's slightly different logits
    kept at the boundary) joins it, so its log-prob stays finite: callers count those rows.
    """
    if top_p >= 1.0:
        zeros = torch.zeros(len(targets), device=logits.device)
        return zeros, torch.zeros(len(targets), dtype=torch.bool, device=logits.device)
    probs = torch.softmax(logits.float(), dim=-1)
    floor = nucleus_floor(probs, top_p)
    target_probs = probs.gather(-1, targets[:, None]).squeeze(-1)
    outside = target_probs < floor
    kept_mass = probs.masked_fill_(probs < floor[:, None], 0.0).sum(dim=-1)
    return torch.log(kept_mass + torch.where(outside, target_probs, 0.0)), outside
