"""Top-p (nucleus) truncation as vLLM applies it (Holtzman et al., arXiv:1904.09751): the rule the
engines sample with, shared by the samplers that mirror them and by the trainer's importance
weights, which must compare the engine's truncated log-probs with the same truncation of pi_old.

vLLM (0.32, `apply_top_k_top_p_pytorch`, the path its CPU sampler takes) sorts the logits
ascending, cumsums their softmax and drops every token whose cumulative mass is <= 1 - top_p,
keeping at least the most likely one. A group of tied logits (bf16 logits are full of them) that
straddles the boundary is cut inside the group, at the position the sort put each tied token,
so only the tokens that reach top_p stay: `nucleus_mask` keeps exactly those tokens.
"""

from __future__ import annotations

import torch

FIRST_K = 64
"""Candidates `nucleus_mask` looks at first: enough for most positions of a trained model."""

MARGIN = 1e-4
"""Mass by which a boundary must clear top_p for the fast path to decide it. vLLM's cumulative
sums are float32 softmax values summed in another order (~1e-6 apart from ours); closer rows
replay vLLM's sort."""


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` ``[..., vocab]`` (already divided by the temperature) with every token outside
    the top-p nucleus set to -inf: vLLM's native sort-based filter, with the same calls.

    torch's default sort is not stable (CPU: 200 of 200 random bf16 rows order their ties
    differently with ``stable=True``), so tied tokens are ordered as vLLM's own call orders them
    only because this is that call, on the same device."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
    drop[..., -1] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def nucleus_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens `top_p_filter` keeps in each row of ``logits`` ``[N, vocab]``: ``[N, vocab]``
    bool (a -inf logit is never kept; it has no mass either way).

    A row whose boundary is clear (no tied logit on both sides of it, its mass `MARGIN` away
    from top_p) is decided from its most likely tokens (`_clear_floors`), a partial top-k that
    costs a fraction of a sort; the others replay vLLM's sort, which alone knows which tokens of
    a tied group it keeps.
    """
    if top_p >= 1.0:
        return torch.isfinite(logits)
    floor, clear = _clear_floors(logits, logits.softmax(dim=-1), top_p)
    kept = logits >= floor[:, None]
    replay = (~clear).nonzero().flatten()
    if len(replay):
        kept[replay] = torch.isfinite(top_p_filter(logits[replay], top_p))
    return kept


def _clear_floors(
    logits: torch.Tensor, probs: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(smallest kept logit ``[N]``, +inf where not clear; the row's boundary is clear ``[N]``)
    from each row's `FIRST_K` most likely tokens, then 16 times as many, then all of them.

    A token is kept while the mass of the tokens above it is below top_p (in float64, so that
    only the float32 softmax values differ from vLLM's sums)."""
    n, vocab = logits.shape
    floor = logits.new_full((n,), float("inf"))
    clear = torch.zeros(n, dtype=torch.bool, device=logits.device)
    rows = torch.arange(n, device=logits.device)
    k = FIRST_K
    while len(rows):
        k = min(k, vocab)
        top, index = logits[rows].topk(k, dim=-1)
        desc = probs[rows].gather(-1, index).double()
        above = desc.cumsum(dim=-1) - desc
        count = (above < top_p).sum(dim=-1, keepdim=True)
        decided = (count < k).squeeze(-1) | (k == vocab)
        last, after = count - 1, count.clamp(max=k - 1)
        cut = (count < k).squeeze(-1)  # some candidate is dropped: the boundary lies inside
        tied = cut & (top.gather(-1, last) == top.gather(-1, after)).squeeze(-1)
        near = (top_p - above.gather(-1, last)).squeeze(-1) <= MARGIN
        near |= cut & ((above.gather(-1, after) - top_p).squeeze(-1) <= MARGIN)
        ok = decided & ~tied & ~near
        floor[rows[ok]] = top.gather(-1, last).squeeze(-1)[ok]
        clear[rows[ok]] = True
        rows = rows[~decided]
        k *= 16
    return floor, clear


def nucleus_log_mass(
    logits: torch.Tensor, targets: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` ``[N, vocab]`` (divided by the temperature): the log of the nucleus'
    probability mass (`nucleus_mask`), and whether ``targets`` ``[N]`` lies outside it (``[N]``
    bool).

    log p(target) - log mass is the target's log-prob under the truncated, renormalised
    distribution. A target outside the nucleus has probability 0 there: its log-prob from the
    mass is meaningless, and the engine importance weight gives it weight 0
    (`rlvr.algorithms.grpo.engine_is_weights`).
    """
    if top_p >= 1.0:
        zeros = torch.zeros(len(targets), device=logits.device)
        return zeros, torch.zeros(len(targets), dtype=torch.bool, device=logits.device)
    logits = logits.float()
    kept = nucleus_mask(logits, top_p)
    outside = ~kept.gather(-1, targets[:, None]).squeeze(-1)
    kept_mass = logits.softmax(dim=-1).masked_fill_(~kept, 0.0).sum(dim=-1)
    return torch.log(kept_mass), outside
