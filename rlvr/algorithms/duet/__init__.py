"""DUET (Hu et al., arXiv:2605.08441): one token budget spent on per-prompt rollout counts
(cost-weighted Neyman allocation, Theorem 1 and Eqs. 1-4) and marker-gated early aborts with
importance weights (Eqs. 5-6). This module holds the allocation and the weights; the online state
lives in `duet.state`, the in-generation stop rule in `duet.stop` (both re-exported here).
"The reference code" is the authors' code, github.com/Haoyu-Hu/DUET, followed where the paper
leaves a detail open.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlvr.algorithms.advantages import group_advantages
from rlvr.algorithms.duet.state import LengthWindow, PromptState
from rlvr.algorithms.duet.stop import (
    MARKER_DOMAINS,
    StopController,
    StopControllerFactory,
    coin,
    has_marker,
    rollout_seed,
)

__all__ = [
    "MARKER_DOMAINS",
    "LengthWindow",
    "PromptState",
    "StepPlan",
    "StopController",
    "StopControllerFactory",
    "allocate",
    "bisect_log_lambda",
    "calibration_chi2",
    "coin",
    "counts_at",
    "duet_advantages",
    "fixed_count",
    "has_marker",
    "make_divisible",
    "neyman_allocation",
    "plan_step",
    "rollout_seed",
    "rollout_weights",
    "stratification",
    "token_budget",
    "variance",
]

BISECT_ITERS = 50
"""Default bisection steps on log(lambda). Our choice: the paper runs 10 steps warm-started from
the previous dual (Alg. 1 line 6); more steps over a fixed bracket need no warm start."""
LOG_LAMBDA_RESOLUTION = 1e-13
"""Width of the final log(lambda) bracket in `allocate` (it takes as many steps as that needs)."""


def _as_1d(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or not np.isfinite(array).all():
        raise ValueError(f"{name} must be a finite 1-d array, got shape {array.shape}")
    return array


def variance(sigma: Sequence[float] | np.ndarray, n: Sequence[float] | np.ndarray) -> float:
    """Trace variance of the policy-gradient estimate, V(n) = sum_q sigma_q^2 / n_q (Eq. 1)."""
    sigma = np.asarray(sigma, dtype=np.float64)
    return float(np.sum(sigma**2 / np.asarray(n, dtype=np.float64)))


def neyman_allocation(
    sigma: Sequence[float] | np.ndarray, lengths: Sequence[float] | np.ndarray, budget: float
) -> tuple[np.ndarray, float]:
    """Continuous minimiser of V(n) s.t. sum_q n_q L_q = budget (Theorem 1, Eq. 2).

    n*_q = (B / S) sigma_q / sqrt(L_q) with S = sum_q sigma_q sqrt(L_q); returns (n*, lambda*)
    with lambda* = (S / B)^2, so V(n*) = S^2 / B = lambda* B.
    """
    sigma = _as_1d(sigma, "sigma")
    lengths = _as_1d(lengths, "lengths")
    total = float(np.sum(sigma * np.sqrt(lengths)))
    return budget / total * sigma / np.sqrt(lengths), (total / budget) ** 2


def counts_at(
    lam: float,
    s_hat: Sequence[float] | np.ndarray,
    l_hat: Sequence[float] | np.ndarray,
    n_min: int = 1,
    n_max: int = 32,
) -> np.ndarray:
    """Integer counts at a dual: n_q(lambda) = clip(round(s_q / sqrt(lambda L_q)), n_min, n_max).

    Rounds half to even (Python's `round`, as the reference code). Eq. 4; `[M]` int64.
    """
    s = np.asarray(s_hat, dtype=np.float64)
    lengths = np.asarray(l_hat, dtype=np.float64)
    return np.clip(np.rint(s / np.sqrt(lam * lengths)), n_min, n_max).astype(np.int64)


def bisect_log_lambda(
    phi: Callable[[float], float],
    budget: float,
    log_lo: float,
    log_hi: float,
    iters: int = BISECT_ITERS,
) -> float:
    """Bisection on log(lambda) for a non-increasing cost phi: the smallest lambda in the bracket
    with phi(lambda) <= budget, to bracket resolution.

    Returns exp(hi) for the final upper end hi, which keeps phi(exp(hi)) <= budget whenever the
    initial upper end did; if phi exceeds the budget on the whole bracket it returns exp(log_hi),
    and if phi fits on the whole bracket it converges to exp(log_lo).
    """
    lo, hi = log_lo, log_hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if phi(math.exp(mid)) > budget:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


def make_divisible(
    n: Sequence[int] | np.ndarray, world_size: int, n_min: int = 1, n_max: int = 32
) -> np.ndarray:
    """Make sum(n) divisible by the data-parallel world size (reference code).

    First takes one rollout at a time from the largest count above n_min (ties: lowest index);
    only if every count reaches n_min first, adds one at a time to the smallest count below
    n_max, which may exceed the budget by less than world_size * max L.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = np.array(n, dtype=np.int64)
    while n.sum() % world_size and (n > n_min).any():
        n[np.argmax(np.where(n > n_min, n, np.iinfo(np.int64).min))] -= 1
    while n.sum() % world_size:
        if not (n < n_max).any():
            raise ValueError(
                f"cannot make {n.sum()} rollouts divisible by {world_size} within n_max"
            )
        n[np.argmin(np.where(n < n_max, n, np.iinfo(np.int64).max))] += 1
    return n


def allocate(
    s_hat: Sequence[float] | np.ndarray,
    l_hat: Sequence[float] | np.ndarray,
    budget: float,
    n_min: int = 1,
    n_max: int = 32,
    world_size: int = 1,
) -> tuple[np.ndarray, float]:
    """Per-prompt rollout counts under a token budget (Eq. 4 + the reference code's repairs).

    Bisects log(lambda) for the smallest dual whose integer counts `counts_at(lambda)` cost
    sum n_q L_q <= budget, down to a 1e-13 wide bracket. The bracket comes from the data and
    holds every step of that cost (at its low end every count is n_max, at its high end n_min),
    so no warm start from the previous step's dual is needed. The counts therefore cost
    <= budget by construction unless n_min everywhere already exceeds it, and then every count
    is n_min: the reference code's hard trim (take rollouts from the longest prompt while over
    budget) would never change anything, so there is none. Finally `make_divisible`. Returns
    (n `[M]` int64, lambda*); lambda* is 0.0 when every s_hat is 0 (all counts n_min whatever
    the dual). Pure and deterministic.
    """
    s = _as_1d(s_hat, "s_hat")
    lengths = _as_1d(l_hat, "l_hat")
    if s.shape != lengths.shape or (s < 0).any() or (lengths <= 0).any():
        raise ValueError("s_hat must be >= 0 and l_hat > 0, both [M]")
    if not 1 <= n_min <= n_max or budget <= 0:
        raise ValueError(f"need 1 <= n_min <= n_max and budget > 0, got {n_min}, {n_max}, {budget}")
    positive = s > 0
    if positive.any():
        ratio = s[positive] ** 2 / lengths[positive]
        # At lambda <= min ratio / (n_max + 1)^2 every ratio term rounds to >= n_max + 1; at
        # lambda >= 16 max ratio every one is <= 1/4 and rounds to 0.
        log_lo = math.log(ratio.min()) - 2.0 * math.log(n_max + 1)
        log_hi = math.log(ratio.max()) + math.log(16.0)
        lam = bisect_log_lambda(
            lambda x: float(counts_at(x, s, lengths, n_min, n_max) @ lengths),
            budget,
            log_lo,
            log_hi,
            iters=math.ceil(math.log2((log_hi - log_lo) / LOG_LAMBDA_RESOLUTION)),
        )
        n = counts_at(lam, s, lengths, n_min, n_max)
    else:
        lam = 0.0
        n = np.full(len(s), n_min, dtype=np.int64)
    return make_divisible(n, world_size, n_min, n_max), lam


def fixed_count(b: float, n_ref: int, n_min: int = 1, n_max: int = 32) -> int:
    """Rollouts per prompt when the allocator is off (the abort-only ablation): round(b * n_ref),
    half to even, which must lie in [n_min, n_max]."""
    n = round(b * n_ref)
    if not n_min <= n <= n_max:
        raise ValueError(
            f"b={b}: round(b * n_ref) = {n} rollouts per prompt is outside "
            f"[n_min, n_max] = [{n_min}, {n_max}]"
        )
    return n


def token_budget(l_hat: Sequence[float] | np.ndarray, b: float, n_ref: int = 8) -> float:
    """Per-step budget B = b * n_ref * sum_q L_hat_q: the paper's "fraction b of full GRPO's
    per-step token cost" (App. A.3) in the reference code's form, with DUET's own lengths."""
    return float(b * n_ref * np.sum(np.asarray(l_hat, dtype=np.float64)))


def stratification(n: Sequence[int] | np.ndarray, eps_pre: float = 0.05) -> np.ndarray:
    """s_pre_q = clip(n_q / nbar, eps_pre, 1) with nbar = max(1, mean n) (Alg. 1 line 9) `[M]`."""
    n = np.asarray(n, dtype=np.float64)
    return np.clip(n / max(1.0, float(n.mean())), eps_pre, 1.0)


def rollout_weights(
    n: Sequence[int] | np.ndarray,
    flags: Sequence[Mapping[str, Any]],
    eps_pre: float = 0.05,
    eps_abort: float = 0.05,
    cap: float = 1000.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-rollout importance weights w = (1 - I_abort) / (s_pre * p_abort), capped (Eq. 6).

    `flags[r]` is rollout r's `StopController.flags()`, rollouts grouped by prompt in order
    (prompt q owns n_q consecutive rows); missing keys count as False (no stop rule ran: a
    natural rollout). p_abort = eps_abort for eps-kept rollouts, else 1. Returns (w `[sum n]`
    float64, keep `[sum n]` bool); aborted rollouts get w = 0 and keep = False (zero loss mask).
    """
    n = np.asarray(n, dtype=np.int64)
    if len(flags) != int(n.sum()):
        raise ValueError(f"{len(flags)} flag dicts for {int(n.sum())} rollouts")
    aborted = np.array([bool(f.get("aborted", False)) for f in flags], dtype=bool)
    eps_kept = np.array([bool(f.get("eps_kept", False)) for f in flags], dtype=bool)
    if (aborted & eps_kept).any():
        raise ValueError("a rollout cannot be both aborted and eps-kept")
    s_pre = np.repeat(stratification(n, eps_pre), n)
    propensity = np.where(eps_kept, eps_abort, 1.0)
    weights = np.where(aborted, 0.0, np.minimum(1.0 / (s_pre * propensity), cap))
    return weights, ~aborted


def duet_advantages(
    rewards: Sequence[float] | np.ndarray,
    n: Sequence[int] | np.ndarray,
    weights: np.ndarray,
    *,
    singleton: str = "reward",
    eps: float = 1e-6,
) -> tuple[np.ndarray, np.ndarray]:
    """GRPO advantages over all n_q rollouts of each prompt (aborted ones included, Alg. 1 line
    38), then scaled by the DUET weights; rows grouped by prompt as in `rollout_weights`.

    A group of one gets A = r by default (verl's convention; the paper trains with verl and does
    not discuss groups of one). Returns (A, w * A), both `[sum n]`: A feeds `PromptState.update`,
    w * A the loss (aborted rows are exactly 0).
    """
    n = np.asarray(n, dtype=np.int64)
    groups = np.repeat(np.arange(len(n)), n)
    adv = group_advantages(
        np.asarray(rewards, dtype=np.float64), groups, eps=eps, singleton=singleton
    )
    return adv, adv * np.asarray(weights, dtype=np.float64)


def calibration_chi2(
    s_hat: Sequence[float] | np.ndarray,
    sigma_emp: Sequence[float] | np.ndarray,
    floor: float = 1e-6,
) -> float:
    """Surrogate calibration chi^2(s_hat, sigma) = mean_q (s_hat_q / sigma_q - 1)^2 over the batch.

    The paper's tracking proxy for Theorem 2 (Eq. 7; App. A.4): s_hat as used for the allocation
    against the step's within-group sigma_obs_{q,t}, the latter clipped below at `floor`.
    """
    s = np.asarray(s_hat, dtype=np.float64)
    sigma = np.maximum(np.asarray(sigma_emp, dtype=np.float64), floor)
    return float(np.mean((s / sigma - 1.0) ** 2))


@dataclass(frozen=True)
class StepPlan:
    """Phase 1 of a DUET step: what to generate and the weights' stratification factors."""

    counts: np.ndarray
    """n_q per prompt `[M]` int64."""
    lam: float | None
    """The budget dual lambda* (None when the allocator is off)."""
    s_hat: np.ndarray
    l_hat: np.ndarray
    budget: float
    planned_tokens: float
    """sum_q n_q L_hat_q of the final counts (<= budget unless n_min or divisibility binds)."""
    s_pre: np.ndarray


def plan_step(
    prompt_ids: Sequence[Hashable],
    state: PromptState,
    window: LengthWindow,
    *,
    b: float,
    n_ref: int = 8,
    n_min: int = 1,
    n_max: int = 32,
    world_size: int = 1,
    eps_pre: float = 0.05,
    neyman: bool = True,
) -> StepPlan:
    """Allocate one batch: s_hat and L_hat from the state (cold L_hat = window mean, else
    max_len), B = b * n_ref * sum L_hat, then `allocate`.

    `neyman=False` is the abort-only ablation: every prompt gets `fixed_count(b, n_ref)`
    rollouts (then `make_divisible`), lambda* is None and s_pre = 1 for equal counts.
    """
    cold = window.cold_length()
    s = np.array([state.s_hat(q) for q in prompt_ids], dtype=np.float64)
    lengths = np.array([state.l_hat(q, cold) for q in prompt_ids], dtype=np.float64)
    budget = token_budget(lengths, b, n_ref)
    if neyman:
        counts, lam = allocate(s, lengths, budget, n_min, n_max, world_size)
    else:
        fixed = np.full(len(s), fixed_count(b, n_ref, n_min, n_max), dtype=np.int64)
        counts, lam = make_divisible(fixed, world_size, n_min, n_max), None
    return StepPlan(
        counts=counts,
        lam=lam,
        s_hat=s,
        l_hat=lengths,
        budget=budget,
        planned_tokens=float(counts @ lengths),
        s_pre=stratification(counts, eps_pre),
    )
