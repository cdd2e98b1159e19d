"""GRPO core (arXiv:2402.03300, Sec. 4.1): the PPO-clip token loss and the k3 KL estimator.

Pure functions over torch in the style of verl's core_algos; a config string picks the loss
aggregation from a small registry (the advantages are `rlvr.algorithms.advantages`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlvr.algorithms.advantages import lookup

LossAggregation = Callable[[torch.Tensor, torch.Tensor, int | None], torch.Tensor]

LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}


def register_loss_agg(name: str) -> Callable[[LossAggregation], LossAggregation]:
    """Register `fn(token_loss, mask, max_len) -> scalar` under `name` for `policy_loss(agg=name)`."""

    def wrap(fn: LossAggregation) -> LossAggregation:
        LOSS_AGGREGATIONS[name] = fn
        return fn

    return wrap


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is true (0 when none); NaN/inf outside stay out.

    Uses `torch.where`, not `x * mask`: 0 * inf is NaN, and masked positions may hold -inf log-probs.
    """
    mask = mask.bool()
    total = torch.where(mask, x, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp(min=1)


KL_LOG_RATIO_BOUND = 20.0
"""|ref - logp| is clamped here before the exp of `kl_k3` (verl's low_var_kl), so exp stays finite."""
KL_K3_BOUND = 10.0
"""Each token's k3 is clamped to [-KL_K3_BOUND, KL_K3_BOUND] (verl's low_var_kl): one token whose
reference log-prob is far below the policy's (e^20 - 21 unclamped) cannot dominate the step."""


def kl_k3(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, always >= 0.

    Schulman's low-variance unbiased estimator for samples drawn from pi. Shapes `[batch, seq]`.
    As in verl, ref - logp is clamped to +-`KL_LOG_RATIO_BOUND` and the estimate to
    +-`KL_K3_BOUND`; a clamped token passes no gradient. With `mask`, positions outside it are
    exactly 0 and pass no gradient, even where the log-probs there are -inf or NaN (the
    difference is selected before the exp).
    """
    diff = ref_logp - logp
    if mask is not None:
        diff = torch.where(mask.bool(), diff, torch.zeros_like(diff))
    diff = diff.clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    return (torch.exp(diff) - diff - 1.0).clamp(-KL_K3_BOUND, KL_K3_BOUND)


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    max_len: int | None = None,
) -> torch.Tensor:
    """`kl_k3` aggregated like the policy loss (`agg`, as verl's kl_loss with loss_agg_mode), so
    the KL and PG terms weigh tokens and sequences the same way."""
    aggregate = lookup(LOSS_AGGREGATIONS, agg, "loss aggregation")
    mask = mask.bool()
    return aggregate(kl_k3(logp, ref_logp, mask), mask, max_len)


ENGINE_IS_MODES = ("off", "tis", "mask")


def engine_is_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "tis",
    cap: float = 2.0,
    outside: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights correcting the engine/trainer mismatch: rho = exp(old_logp - rollout_logp).

    The rollouts were drawn by the inference engine (mu), the loss assumes the trainer's
    pi_old; "tis" weights each token by min(rho, cap) (truncated importance sampling, as verl and
    OpenRLHF), "mask" keeps rho <= cap at weight 1 and drops the rest (weight 0, still counted in
    the loss's denominator), "off" weights 1. `old_logp` must be pi_old's log-prob under the
    distribution the engine sampled from (its top-p nucleus included), so that identical weights
    give rho = 1; a token the engine drew from a one-token nucleus (rollout_logp 0) is weighted
    like any other. `forced` (`[batch, seq]` bool) marks tokens no distribution drew (a stop
    rule's forced EOS): they keep weight 1 and stay out of the statistics.

    `outside` (`[batch, seq]` bool) marks tokens outside pi_old's own top-p nucleus
    (`nucleus.nucleus_log_mass`). pi_old's truncated distribution gives them probability 0, so
    rho is 0 and their weight 0 in both "tis" and "mask": the importance weight of a draw the
    target cannot make (Owen, Monte Carlo theory, ch. 9), what IcePop's and masked importance
    sampling's masks give a token whose ratio leaves the trust band. With identical weights no
    token is outside (the nucleus is vLLM's own); under staleness the share grows.

    Returns detached weights `[batch, seq]` (1 outside `mask`) and 0-dim stats over the compared
    tokens (`mask` and not `forced`): engine_ratio_mean / engine_ratio_max (rho),
    engine_capped_frac (rho > cap), engine_kl, the k1 estimate of KL(mu || pi_old) =
    E_mu[rollout_logp - old_logp] over the compared tokens inside pi_old's nucleus (outside it
    log rho is -inf), engine_outside_frac (the share of `outside` tokens), and the token counts
    the means are over: engine_tokens (compared) and engine_inside_tokens (engine_kl's).
    """
    if mode not in ENGINE_IS_MODES:
        raise ValueError(f"engine importance mode must be one of {ENGINE_IS_MODES}, got {mode!r}")
    if not cap >= 1.0:
        raise ValueError(f"the importance cap must be >= 1, got {cap}")
    with torch.no_grad():
        compared = mask.bool() if forced is None else mask.bool() & ~forced
        out = torch.zeros_like(compared) if outside is None else outside & compared
        inside = compared & ~out
        zeros = torch.zeros_like(old_logp)
        log_rho = torch.where(inside, old_logp - rollout_logp, zeros)
        rho = torch.where(out, zeros, torch.exp(log_rho))
        capped = compared & (rho > cap)
        if mode == "tis":
            weights = torch.where(compared, rho.clamp(max=cap), torch.ones_like(rho))
        elif mode == "mask":
            weights = (~(capped | out)).to(old_logp.dtype)
        else:
            weights = torch.ones_like(rho)
        stats = {
            "engine_ratio_mean": masked_mean(rho, compared),
            "engine_ratio_max": torch.where(
                compared.any(), torch.where(compared, rho, zeros).max(), 1.0
            ),
            "engine_capped_frac": masked_mean(capped.to(old_logp.dtype), compared),
            "engine_kl": masked_mean(-log_rho, inside),
            "engine_outside_frac": masked_mean(out.to(old_logp.dtype), compared),
            "engine_tokens": compared.sum().to(old_logp.dtype),
            "engine_inside_tokens": inside.sum().to(old_logp.dtype),
        }
    return weights, stats


@register_loss_agg("token-mean")
def _token_mean(loss: torch.Tensor, mask: torch.Tensor, max_len: int | None) -> torch.Tensor:
    # Every valid token of the batch counts equally (DAPO): long responses weigh more.
    return masked_mean(loss, mask)


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(
    loss: torch.Tensor, mask: torch.Tensor, max_len: int | None
) -> torch.Tensor:
    # Original GRPO: each sequence counts equally; sequences with no valid token are skipped.
    counts = mask.sum(dim=-1)
    seq_sums = torch.where(mask, loss, torch.zeros_like(loss)).sum(dim=-1)
    seq_means = seq_sums / counts.clamp(min=1)
    has_tokens = counts > 0
    return torch.where(
        has_tokens, seq_means, torch.zeros_like(seq_means)
    ).sum() / has_tokens.sum().clamp(min=1)


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, max_len: int | None
) -> torch.Tensor:
    # Dr.GRPO: a constant normaliser removes the length bias of per-sequence means; every
    # sequence of the batch (also an empty one) counts in the mean.
    norm = loss.shape[-1] if max_len is None else max_len
    seq_sums = torch.where(mask, loss, torch.zeros_like(loss)).sum(dim=-1)
    return (seq_sums / norm).mean()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
    max_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip policy loss with asymmetric clipping, aggregated by `agg`.

    Shapes: `logp`, `old_logp`, `mask` `[batch, seq]`; `advantages` `[batch]` or `[batch, seq]`;
    `weights` `[batch]` (e.g. DUET importance weights) multiply each sequence's token losses,
    `token_weights` `[batch, seq]` (the engine importance correction) each token's.
    Per token: max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)) with
    ratio = exp(logp - old_logp). Positions outside `mask` may hold -inf/NaN log-probs; they are
    removed with `torch.where` before the exp, so the loss and its gradients stay finite.
    `max_len` is the constant of "seq-mean-token-sum-norm" (default: the seq dim); keep it the same
    across micro-batches of one step.

    Returns the scalar loss and detached 0-dim stats: clip_frac (tokens whose clipped term is
    active), clip_frac_low / clip_frac_high (by side), approx_kl (mean old - new log-prob),
    ratio_mean, ratio_max, ratio_min (over valid tokens).
    """
    aggregate = lookup(LOSS_AGGREGATIONS, agg, "loss aggregation")
    mask = mask.bool()
    zeros = torch.zeros_like(logp)
    log_ratio = torch.where(mask, logp - old_logp, zeros)
    ratio = torch.exp(log_ratio)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    adv = torch.where(mask, advantages.to(logp.dtype), zeros)

    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    if weights is not None:
        token_loss = token_loss * weights.to(token_loss.dtype)[:, None]
    if token_weights is not None:
        token_loss = token_loss * torch.where(mask, token_weights.to(token_loss.dtype), zeros)
    loss = aggregate(token_loss, mask, max_len)

    with torch.no_grad():
        is_clipped = (clipped > unclipped) & mask
        # Fill values keep the max/min on device (boolean indexing would sync a GPU).
        any_valid = mask.any()
        stats = {
            "clip_frac": masked_mean(is_clipped.to(logp.dtype), mask),
            "clip_frac_low": masked_mean((is_clipped & (ratio < 1.0)).to(logp.dtype), mask),
            "clip_frac_high": masked_mean((is_clipped & (ratio > 1.0)).to(logp.dtype), mask),
            "approx_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": torch.where(any_valid, torch.where(mask, ratio, zeros).max(), 1.0),
            "ratio_min": torch.where(
                any_valid, torch.where(mask, ratio, torch.full_like(ratio, torch.inf)).min(), 1.0
            ),
        }
    return loss, stats
