"""LACONIC: a corpus-level length budget as a constraint, solved by primal-dual steps.

LACONIC (Liu et al., "LACONIC: Length-Aware Constrained Reinforcement Learning for LLM"; equation
numbers are the paper's). Primal: GRPO on the Lagrangian reward r - lambda * max(L/B - 1, 0)
(Eqs. 6-8); dual: once per step, lambda <- clip(lambda + eta * (mean L / B - 1), 0, lam_max)
(Eq. 9); Algorithm 1 alternates them. Also two numpy toys of ours that check the dual map (the
idealised dynamics of App. C.1) and its coupling with GRPO.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from rlvr.algorithms.advantages import group_advantages

# eta = 0.002 is inferred from the paper's eta ablation (its eta=0.002 row of Table 6 equals
# LACONIC B=1500 in Table 3); lam_max = 0.3 is the ceiling of its eta ablation (Sec. 5.3, Fig. 6);
# lam_init is an input of Algorithm 1 with no value given: our choice 0 makes step 0 plain GRPO.
DEFAULT_ETA = 0.002
DEFAULT_LAM_MAX = 0.3
DEFAULT_LAM_INIT = 0.0

LengthCost = Callable[[np.ndarray, float], np.ndarray]
LENGTH_COSTS: dict[str, LengthCost] = {}


def register_length_cost(name: str) -> Callable[[LengthCost], LengthCost]:
    """Register `fn(lengths, budget) -> cost [batch]` under `name` for `lagrangian_rewards`."""

    def wrap(fn: LengthCost) -> LengthCost:
        LENGTH_COSTS[name] = fn
        return fn

    return wrap


def _check_budget(budget: float) -> float:
    budget = float(budget)
    if not (budget > 0 and math.isfinite(budget)):
        raise ValueError(f"budget must be a positive finite number of tokens, got {budget}")
    return budget


def _lengths(lengths: np.ndarray | list[int]) -> np.ndarray:
    lens = np.asarray(lengths, dtype=np.float64)
    if lens.ndim != 1:
        raise ValueError(f"lengths must be [batch], got shape {lens.shape}")
    if np.any(lens < 0) or not np.all(np.isfinite(lens)):
        raise ValueError("lengths must be finite and >= 0")
    return lens


@register_length_cost("hinge")
def length_cost(lengths: np.ndarray | list[int], budget: float) -> np.ndarray:
    """LACONIC's per-response cost max(L/B - 1, 0) `[batch]` (Eq. 6).

    Zero within budget, so nothing pushes a response shorter than B; not clipped above (at most
    Lmax/B - 1). Truncated responses count with their capped length.
    """
    budget = _check_budget(budget)
    return np.maximum(_lengths(lengths) / budget - 1.0, 0.0)


@register_length_cost("linear")
def linear_length_cost(lengths: np.ndarray | list[int], budget: float) -> np.ndarray:
    """Signed cost L/B - 1 `[batch]` of standard primal-dual (Eq. 4), kept for the ablation.

    Negative under budget, so any lambda > 0 rewards shortening every response; the paper shows it
    collapses lengths far below B before recovering (App. A.2, Tables 4-5).
    """
    budget = _check_budget(budget)
    return _lengths(lengths) / budget - 1.0


def lagrangian_rewards(
    rewards: np.ndarray | list[float],
    lengths: np.ndarray | list[int],
    budget: float,
    lam: float,
    cost: Literal["hinge", "linear"] = "hinge",
) -> np.ndarray:
    """Lagrangian rewards r - lam * cost(L) `[batch]` (Eq. 7), fed to GRPO (Eq. 8) in place of r.

    `lam` is the value read once for the whole step. At lam = 0 the result equals `rewards`
    bit for bit (as float64), so the step is exactly a GRPO step.
    """
    if cost not in LENGTH_COSTS:
        raise ValueError(f"unknown length cost {cost!r}; choose one of {sorted(LENGTH_COSTS)}")
    lam = float(lam)
    if not (lam >= 0 and math.isfinite(lam)):
        raise ValueError(f"lambda must be finite and >= 0, got {lam}")
    r = np.asarray(rewards, dtype=np.float64)
    c = LENGTH_COSTS[cost](lengths, budget)
    if r.shape != c.shape:
        raise ValueError(f"rewards {r.shape} and lengths {c.shape} must have the same shape")
    return r - lam * c


def dual_update(lam: float, mean_length: float, budget: float, eta: float, lam_max: float) -> float:
    """One projected dual step clip(lam + eta * (mean_length / B - 1), 0, lam_max) (Eq. 9).

    Driven by the SIGNED violation of the step's plain mean length: with the clipped cost here
    lambda could never decrease. `lam_max` is the ceiling Lambda (see `safe_lambda_ceiling`).
    """
    budget = _check_budget(budget)
    if not (eta >= 0 and math.isfinite(eta)):
        raise ValueError(f"eta must be a finite step size >= 0, got {eta}")
    if not lam_max >= 0:
        raise ValueError(f"lam_max must be >= 0, got {lam_max}")
    if not (lam >= 0 and math.isfinite(lam)):
        raise ValueError(f"lambda must be finite and >= 0, got {lam}")
    if not (mean_length >= 0 and math.isfinite(mean_length)):
        raise ValueError(f"mean_length must be finite and >= 0, got {mean_length}")
    return min(max(float(lam) + float(eta) * (float(mean_length) / budget - 1.0), 0.0), lam_max)


def safe_lambda_ceiling(budget: float, max_tokens: int) -> float:
    """The ceiling B / (Lmax - B) below which a correct answer of any length outscores a wrong one.

    With r in {0, 1}: 1 - lam * (Lmax - B) / B > 0 iff lam < B / (Lmax - B) (Sec. 2.3); at the
    ceiling itself a correct Lmax-long answer ties with a wrong short one. Needs B < Lmax.
    """
    budget = _check_budget(budget)
    if budget >= max_tokens:
        raise ValueError(
            f"length budget {budget:g} must be below the max response length {max_tokens}: "
            "a budget no response can exceed never constrains anything"
        )
    return budget / (max_tokens - budget)


def resolve_lam_max(
    lam_max: float | Literal["auto"], budget: float, max_tokens: int
) -> tuple[float, str | None]:
    """The numeric ceiling ("auto" = `safe_lambda_ceiling`) and a warning when it is above that.

    Above the safe ceiling a correct but long answer can score below a wrong short one; the paper
    still uses 0.3 (unsafe for B < 945 at Lmax 4096), so this warns instead of refusing.
    """
    safe = safe_lambda_ceiling(budget, max_tokens)
    if lam_max == "auto":
        return safe, None
    lam_max = float(lam_max)
    if not lam_max >= 0:
        raise ValueError(f"lam_max must be >= 0 or 'auto', got {lam_max}")
    if lam_max > safe:
        return lam_max, (
            f"LACONIC lam_max={lam_max:g} exceeds the safe ceiling B/(Lmax-B)={safe:.4f} "
            f"(B={budget:g}, Lmax={max_tokens}): a correct {max_tokens}-token answer can score "
            "below a wrong short one"
        )
    return lam_max, None


@dataclass
class DualState:
    """The LACONIC dual variable with its once-per-step update, owned by the ControllerActor.

    `lam` is the value for the next step (`last_step + 1`). Steps arrive in order from 0; a retried
    step is a no-op returning the value it computed, so Ray retries never double-apply.
    `history` holds (step, lam_used, lam_next, mean_length) per applied step.
    """

    budget: float
    eta: float = DEFAULT_ETA
    lam_max: float = DEFAULT_LAM_MAX
    lam: float = DEFAULT_LAM_INIT
    last_step: int = -1
    history: list[tuple[int, float, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_budget(self.budget)
        if not (self.eta >= 0 and math.isfinite(self.eta)):  # 0: the fixed-lambda ablation
            raise ValueError(f"eta must be a finite step size >= 0, got {self.eta}")
        if not 0 <= self.lam <= self.lam_max:
            raise ValueError(f"lambda {self.lam} must lie in [0, lam_max={self.lam_max}]")

    def _applied(self, step: int) -> tuple[int, float, float, float]:
        # History holds consecutive steps, so a step's entry sits at a fixed offset.
        idx = step - self.history[0][0] if self.history else -1
        if not 0 <= idx < len(self.history) or self.history[idx][0] != step:
            raise ValueError(f"step {step} is not in the dual history")
        return self.history[idx]

    def lambda_for_step(self, step: int) -> float:
        """The lambda that step `step` must use: the current one, or the recorded one on a retry."""
        if step == self.last_step + 1:
            return self.lam
        if step <= self.last_step:
            return self._applied(step)[1]
        raise ValueError(
            f"lambda for step {step} requested, but the next step is {self.last_step + 1}"
        )

    def step_update(self, step: int, mean_length: float) -> float:
        """Apply step `step`'s dual update from its mean length over ALL generated responses.

        Returns the lambda for the next step. A step already applied returns its recorded result
        and changes nothing; a step that skips ahead raises.
        """
        if step <= self.last_step:
            return self._applied(step)[2]
        if step != self.last_step + 1:
            raise ValueError(
                f"dual update for step {step}, but the next step is {self.last_step + 1}"
            )
        lam_used = self.lam
        self.lam = dual_update(lam_used, mean_length, self.budget, self.eta, self.lam_max)
        self.last_step = step
        self.history.append((step, lam_used, self.lam, float(mean_length)))
        return self.lam

    def state_dict(self) -> dict[str, Any]:
        """JSON-plain snapshot; Python's float repr makes the JSON round trip exact."""
        return {
            "budget": float(self.budget),
            "eta": float(self.eta),
            "lam_max": float(self.lam_max),
            "lam": float(self.lam),
            "last_step": int(self.last_step),
            "history": [[int(s), float(u), float(n), float(m)] for s, u, n, m in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (parameters included) so a resumed run continues identically."""
        self.budget = float(state["budget"])
        self.eta = float(state["eta"])
        self.lam_max = float(state["lam_max"])
        self.lam = float(state["lam"])
        self.last_step = int(state["last_step"])
        self.history = [(int(s), float(u), float(n), float(m)) for s, u, n, m in state["history"]]
        self.__post_init__()


def step_metrics(
    rewards: np.ndarray | list[float],
    lengths: np.ndarray | list[int],
    truncated: np.ndarray | list[bool],
    budget: float,
    lam_used: float,
    lam_next: float,
    cost: Literal["hinge", "linear"] = "hinge",
) -> dict[str, float]:
    """Per-step LACONIC metrics over all responses of the step (before any filtering)."""
    r = np.asarray(rewards, dtype=np.float64)
    lens = _lengths(lengths)
    trunc = np.asarray(truncated, dtype=bool)
    if not (r.shape == lens.shape == trunc.shape) or r.size == 0:
        raise ValueError("rewards, lengths and truncated must be non-empty and of equal shape")
    budget = _check_budget(budget)
    ell = lagrangian_rewards(r, lens, budget, lam_used, cost)
    return {
        "laconic_lambda": float(lam_used),
        "laconic_lambda_next": float(lam_next),
        "laconic_length_mean": float(lens.mean()),
        "laconic_length_over_budget": float(lens.mean() / budget),
        "laconic_over_budget_frac": float(np.mean(lens > budget)),
        "laconic_truncated_frac": float(trunc.mean()),
        "laconic_cost_mean": float(LENGTH_COSTS[cost](lens, budget).mean()),
        "laconic_reward_mean": float(r.mean()),
        "laconic_lagrangian_reward_mean": float(ell.mean()),
    }


def best_response_length(lam: float, budget: float, max_tokens: int, tau: float) -> float:
    """Exact maximiser over L of 1 - exp(-L/tau) - lam * max(L/B - 1, 0) (a toy of ours).

    Within budget the cost is 0 and success grows with L, so L >= B; above it the first-order
    condition gives tau * ln(B / (lam * tau)); lam = 0 picks Lmax.
    """
    if lam <= 0:
        return float(max_tokens)
    return float(np.clip(tau * math.log(budget / (lam * tau)), budget, max_tokens))


def simulate_best_response(
    steps: int,
    eta: float,
    budget: float = 1000.0,
    max_tokens: int = 4096,
    tau: float = 500.0,
    lam_max: float = DEFAULT_LAM_MAX,
    lam_init: float = DEFAULT_LAM_INIT,
) -> dict[str, np.ndarray]:
    """Idealised LACONIC (App. C.1, Eq. 21): the policy plays the exact best response to lambda.

    Success probability 1 - exp(-L/tau). The dual map converges to lam* = (B/tau) exp(-B/tau)
    with L -> B (Thm C.4). Returns per-step arrays `[steps]`: lam (used), length, reward.
    """
    state = DualState(budget, eta, lam_max, lam_init)
    lam_hist, len_hist = np.empty(steps), np.empty(steps)
    for t in range(steps):
        lam_hist[t] = state.lam
        len_hist[t] = best_response_length(state.lam, budget, max_tokens, tau)
        state.step_update(t, len_hist[t])
    return {"lam": lam_hist, "length": len_hist, "reward": 1.0 - np.exp(-len_hist / tau)}


BANDIT_ARM_LENGTHS = (250, 500, 750, 1000, 1500, 2000, 3000, 4000)


def simulate_bandit(
    steps: int = 1500,
    seed: int = 0,
    budget: float = 1000.0,
    eta: float = 0.01,
    lam_max: float = 1.0,
    lam_init: float = DEFAULT_LAM_INIT,
    cost: Literal["hinge", "linear"] = "hinge",
    prompts: int = 32,
    group_size: int = 8,
    lr: float = 0.2,
    tau: float = 500.0,
    arm_lengths: tuple[int, ...] = BANDIT_ARM_LENGTHS,
) -> dict[str, np.ndarray]:
    """Stochastic bandit trained by GRPO on Lagrangian rewards with the dual update (our toy).

    Each arm is a "strategy" of fixed length L with success probability 1 - exp(-L/tau); a softmax
    policy (logits 0, the longest arm 3) samples `prompts` groups of `group_size` per step, takes
    one exact score-function SGD step on mean(A * log pi), then the dual steps on the batch mean
    length. The constrained optimum at B = 1000 is the 1000-token arm (success 0.8647).
    Returns per-step arrays `[steps]`: lam (used), batch_length (Lbar), policy_length (expected
    length under the policy after the step) and success (its expected success).
    """
    rng = np.random.default_rng(seed)
    lengths = np.asarray(arm_lengths, dtype=np.float64)
    success = 1.0 - np.exp(-lengths / tau)
    logits = np.zeros(len(lengths))
    logits[-1] = 3.0
    group_ids = np.repeat(np.arange(prompts), group_size)
    n = prompts * group_size
    state = DualState(budget, eta, lam_max, lam_init)
    out = {k: np.empty(steps) for k in ("lam", "batch_length", "policy_length", "success")}
    for t in range(steps):
        pi = np.exp(logits - logits.max())
        pi /= pi.sum()
        arms = rng.choice(len(lengths), size=n, p=pi)
        rewards = (rng.random(n) < success[arms]).astype(np.float64)
        lam = state.lam
        adv = group_advantages(
            lagrangian_rewards(rewards, lengths[arms], budget, lam, cost), group_ids
        )
        # d/dlogits of mean_n A_n log pi(a_n) = mean_n A_n (onehot(a_n) - pi).
        grad = np.bincount(arms, weights=adv, minlength=len(lengths)) / n - adv.mean() * pi
        logits += lr * grad
        state.step_update(t, float(lengths[arms].mean()))
        pi = np.exp(logits - logits.max())
        pi /= pi.sum()
        out["lam"][t] = lam
        out["batch_length"][t] = lengths[arms].mean()
        out["policy_length"][t] = pi @ lengths
        out["success"][t] = pi @ success
    return out
