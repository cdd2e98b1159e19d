"""DUET's per-run controller (arXiv:2605.08441, Alg. 1 phases 1 and 4): the per-prompt state, the
K1/K2 length window and the budget dual lambda*, planned and updated exactly once per training
step, plus the step's metrics. The ControllerActor owns one; everything crossing the actor
boundary is plain JSON.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlvr.algorithms.duet import StepPlan, calibration_chi2, plan_step
from rlvr.algorithms.duet.state import LengthWindow, PromptState


class DuetController:
    """Plans one step's rollout counts and folds the step's kept rollouts into the state, once.

    The pure `PromptState` and `LengthWindow` are not idempotent, so this class guards them by
    step number: steps arrive in order from 0, a repeated `plan` for the planned step returns the
    same plan, a repeated `update` of the last applied step returns its recorded metrics and
    changes nothing, and a step out of order raises. The plan of the step in flight is kept in
    memory only: it is a pure function of the checkpointed state, so a resumed run recomputes it.
    """

    def __init__(
        self,
        *,
        b: float,
        max_len: int,
        n_ref: int = 8,
        n_min: int = 1,
        n_max: int = 32,
        eps_pre: float = 0.05,
        world_size: int = 1,
        k_warmup: int = 1,
        s_floor: float = 0.01,
        floor_min: float = 0.0,
        length_window: int = 1024,
        refit_every: int = 10,
        k1_min: int = 32,
        k2_gap: int = 50,
        allocate: bool = True,
    ) -> None:
        """`allocate=False` is the abort-only ablation: round(b * n_ref) rollouts per prompt;
        the per-prompt state is still tracked (its metrics stay comparable)."""
        self.b = b
        self.allocate = allocate
        self.n_ref = n_ref
        self.n_min = n_min
        self.n_max = n_max
        self.eps_pre = eps_pre
        self.world_size = world_size
        self.prompts = PromptState(k_warmup=k_warmup, s_floor_init=s_floor, floor_min=floor_min)
        self.window = LengthWindow(
            max_len, size=length_window, refit_every=refit_every, k1_min=k1_min, k2_gap=k2_gap
        )
        self.lam: float | None = None
        """lambda* of the last applied step (None before the first, or with the allocator off)."""
        self.last_step = -1
        self._plan: tuple[int, list[str], StepPlan, dict[str, Any]] | None = None
        self._update: tuple[int, dict[str, Any]] | None = None

    def plan(self, step: int, prompt_ids: Sequence[str]) -> dict[str, Any]:
        """Counts for `step` (aligned with `prompt_ids`) and the values the step runs with.

        Returns JSON-plain: counts, lambda, budget, planned_tokens, k1, k2, s_hat, l_hat, s_pre
        (per-prompt lists in `prompt_ids` order) and time_duet_plan (seconds of allocation).
        A repeated prompt id raises ValueError: counts are per prompt, so its groups would merge.
        """
        ids = list(prompt_ids)
        repeated = [q for q, count in Counter(ids).items() if count > 1]
        if repeated:
            raise ValueError(f"step {step} holds prompts {repeated} more than once")
        if self._plan is not None and self._plan[0] == step:
            if self._plan[1] != ids:
                raise ValueError(f"step {step} was planned for other prompts")
            return self._plan[3]
        if step != self.last_step + 1:
            raise ValueError(f"plan for step {step}, but the next step is {self.last_step + 1}")
        t = time.perf_counter()
        plan = plan_step(
            ids,
            self.prompts,
            self.window,
            b=self.b,
            n_ref=self.n_ref,
            n_min=self.n_min,
            n_max=self.n_max,
            world_size=self.world_size,
            eps_pre=self.eps_pre,
            neyman=self.allocate,
        )
        out = {
            "counts": plan.counts.tolist(),
            "lambda": plan.lam,
            "budget": plan.budget,
            "planned_tokens": plan.planned_tokens,
            "k1": self.window.k1,
            "k2": self.window.k2,
            "s_hat": plan.s_hat.tolist(),
            "l_hat": plan.l_hat.tolist(),
            "s_pre": plan.s_pre.tolist(),
            "time_duet_plan": time.perf_counter() - t,
        }
        self._plan = (step, ids, plan, out)
        return out

    def update(
        self,
        step: int,
        prompt_ids: Sequence[str],
        advantages: Sequence[float],
        logprob_sums: Sequence[float],
        lengths: Sequence[int],
        kept: Sequence[bool],
        epoch_end: bool = False,
    ) -> dict[str, Any]:
        """Fold step `step`'s rollouts (one entry each) into the state; returns its metrics.

        `advantages` are the unweighted group advantages, `logprob_sums` the old-policy
        log-prob of each response summed over its tokens (anything for aborted rollouts),
        `kept` False for aborted rollouts. Kept lengths feed the K1/K2 window (refit when due);
        `epoch_end` marks the last step of an epoch (the s_floor schedule). A retry of the last
        applied step returns its recorded metrics; `plan(step)` must have been called first.
        """
        if self._update is not None and self._update[0] == step:
            return self._update[1]
        if step != self.last_step + 1:
            raise ValueError(
                f"DUET update for step {step}, but the next step is {self.last_step + 1}"
            )
        if self._plan is None or self._plan[0] != step:
            raise ValueError(f"DUET update for step {step} before its plan")
        t = time.perf_counter()
        plan_ids, plan = self._plan[1], self._plan[2]
        keep = np.asarray(kept, dtype=bool)
        sigma_t = self.prompts.update(prompt_ids, advantages, logprob_sums, lengths, keep)
        kept_lengths = [int(n) for n, k in zip(lengths, keep, strict=True) if k]
        refit = self.window.observe(kept_lengths, step)
        if epoch_end:
            self.prompts.end_epoch()
        self.lam = plan.lam
        self.last_step = step

        s_hat = dict(zip(plan_ids, plan.s_hat.tolist(), strict=True))
        observed = sorted(sigma_t)
        metrics: dict[str, Any] = {
            "duet_surrogate_updates": len(observed),
            "duet_sigma_obs_mean": (
                float(np.mean([sigma_t[q] for q in observed])) if observed else None
            ),
            "duet_calibration_chi2": (
                calibration_chi2([s_hat[q] for q in observed], [sigma_t[q] for q in observed])
                if observed
                else None
            ),
            "duet_refit": refit,
            "duet_k1_next": self.window.k1,
            "duet_k2_next": self.window.k2,
            "duet_s_floor": self.prompts.s_floor,
            "duet_prompts_tracked": len(self.prompts),
            "time_duet_update": time.perf_counter() - t,
        }
        self._update = (step, metrics)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """JSON-plain snapshot of everything a resumed run needs to plan identically."""
        return {
            "prompts": self.prompts.state_dict(),
            "window": self.window.state_dict(),
            "lam": self.lam,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict` snapshot (settings stay as constructed)."""
        self.prompts.load_state_dict(state["prompts"])
        self.window.load_state_dict(state["window"])
        self.lam = None if state["lam"] is None else float(state["lam"])
        self.last_step = int(state["last_step"])
        self._plan = None
        self._update = None


def step_metrics(
    plan: Mapping[str, Any],
    flags: Sequence[Mapping[str, Any]],
    weights: Sequence[float] | np.ndarray,
    lengths: Sequence[int],
    n_min: int,
    n_max: int,
) -> dict[str, Any]:
    """One step's DUET metrics from its plan and rollouts (Alg. 1 line 57's log, and more).

    Counts: mean/std/min/max, the share of prompts at n_min and n_max, a histogram
    {n: prompts}. Budget: lambda*, B, planned sum n_q L_hat_q, realised tokens (every
    generated token, aborted prefixes included) and the tokens saved against B, which is what
    a fixed b * n_ref rollouts per prompt would cost at the same L_hat. Stop rule: marker,
    eps-kept and abort rates, K1/K2 used. Weights: mean and max over kept rollouts.
    """
    counts = np.asarray(plan["counts"], dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    kept = np.array([not f.get("aborted", False) for f in flags], dtype=bool)
    realised = int(np.sum(lengths))
    values, freq = np.unique(counts, return_counts=True)

    def rate(key: str) -> float:
        return float(np.mean([bool(f.get(key, False)) for f in flags])) if flags else 0.0

    return {
        "duet_n_mean": float(counts.mean()),
        "duet_n_std": float(counts.std()),
        "duet_n_min": int(counts.min()),
        "duet_n_max": int(counts.max()),
        "duet_at_n_min_frac": float(np.mean(counts == n_min)),
        "duet_at_n_max_frac": float(np.mean(counts == n_max)),
        "duet_n_hist": {str(int(v)): int(c) for v, c in zip(values, freq, strict=True)},
        "duet_lambda": plan["lambda"],
        "duet_budget": plan["budget"],
        "duet_planned_tokens": plan["planned_tokens"],
        "duet_realised_tokens": realised,
        "duet_tokens_saved": plan["budget"] - realised,
        "duet_tokens_saved_frac": 1.0 - realised / plan["budget"],
        "duet_k1": plan["k1"],
        "duet_k2": plan["k2"],
        "duet_s_hat_mean": float(np.mean(plan["s_hat"])),
        "duet_l_hat_mean": float(np.mean(plan["l_hat"])),
        "duet_marker_rate": rate("marker"),
        "duet_eps_kept_rate": rate("eps_kept"),
        "duet_abort_rate": rate("aborted"),
        "duet_weight_mean": float(w[kept].mean()) if kept.any() else 0.0,
        "duet_weight_max": float(w.max()) if w.size else 0.0,
        "time_duet_plan": plan["time_duet_plan"],
    }
