"""DUET's section of the training config (`algorithm.duet`), its checks across sections, the
controller state it runs on and the settings of each step's in-engine stop rule."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, model_validator

from rlvr.algorithms import duet
from rlvr.config import Config, Section


class DuetConfig(Section):
    """DUET: per-prompt rollout counts and in-engine early stops under one token budget."""

    b: float = Field(
        0.5, gt=0.0, description="Budget fraction: B = b * n_ref * sum of the batch's L_hat."
    )
    n_ref: int = Field(8, gt=0, description="Reference GRPO group size the budget scales.")
    n_min: int = Field(1, ge=1, description="Fewest rollouts per prompt.")
    n_max: int = Field(32, ge=1, description="Most rollouts per prompt.")
    eps_pre: float = Field(
        0.05, gt=0.0, le=1.0, description="Lower clip of the stratification factor s_pre."
    )
    eps_abort: float = Field(
        0.05, ge=0.0, le=1.0, description="Keep-probability of a marker-less rollout at K2+grace."
    )
    grace: int = Field(150, ge=0, description="Tokens allowed after the marker (and after K2).")
    poll_every: int = Field(8, gt=0, description="Marker poll interval in tokens (from K1 on).")
    marker_window: int = Field(
        256, gt=0, description="Trailing tokens decoded for the marker check."
    )
    domain: Literal["math", "code", "qa"] = Field(
        "math", description="Answer marker: \\boxed{} (math), closing fence (code), <answer> (qa)."
    )
    k_warmup: int = Field(
        1, ge=1, description="Surrogate observations before a prompt uses its own s_hat."
    )
    s_floor: float = Field(
        0.01, ge=0.0, description="Surrogate floor in epoch 1 (then frozen at p5 of sigma_obs)."
    )
    floor_min: float = Field(
        0.0, ge=0.0, description="Lower bound of the frozen floor (0: the paper's p5 as is)."
    )
    length_window: int = Field(
        1024, gt=0, description="Kept lengths in the window K1/K2 are fit to."
    )
    refit_every: int = Field(10, gt=0, description="Steps between K1/K2 refits.")
    k1_min: int = Field(32, ge=0, description="Lower clamp of K1 (poll start).")
    k2_gap: int = Field(50, ge=0, description="K2 is at least K1 + k2_gap.")
    allocate: bool = Field(
        True,
        description="Neyman allocation of per-prompt counts; False (ablation): every prompt gets "
        "round(b * n_ref) rollouts and s_pre = 1.",
    )
    early_stop: bool = Field(
        True,
        description="Marker-gated stop/abort in the engine; False (ablation): every rollout runs "
        "to EOS or max_tokens and weights are 1 / s_pre.",
    )

    @model_validator(mode="after")
    def _check(self) -> DuetConfig:
        if not self.n_min <= self.n_ref <= self.n_max:
            raise ValueError(
                f"n_ref={self.n_ref} must satisfy n_min={self.n_min} <= n_ref <= n_max={self.n_max}"
            )
        if self.b * self.n_ref < self.n_min:
            raise ValueError(
                f"b={self.b}: b * n_ref = {self.b * self.n_ref:g} is below n_min={self.n_min}, so "
                "every prompt would get n_min rollouts and the budget could never bind"
            )
        if not self.allocate:
            # raises naming b when the fixed count round(b * n_ref) leaves [n_min, n_max]
            duet.fixed_count(self.b, self.n_ref, self.n_min, self.n_max)
        return self


def check_duet(cfg: Config) -> None:
    """DUET's advantages, ablations and stop-rule clamps against the rest of the config."""
    du, max_tokens = cfg.algorithm.duet, cfg.generation.max_tokens
    if cfg.algorithm.advantage_scale != "group":
        raise ValueError(
            "algorithm.advantage_scale must be 'group' with DUET (its advantages are "
            "group-normalised, Eq. 6 of arXiv:2605.08441)"
        )
    if not (du.allocate or du.early_stop):
        raise ValueError(
            "algorithm.duet.allocate and algorithm.duet.early_stop are both false: that is "
            "plain GRPO with round(b * n_ref) rollouts per prompt; turn one of them on or use "
            "generation.group_size"
        )
    if du.grace >= max_tokens:
        raise ValueError(
            f"algorithm.duet.grace={du.grace} must be below generation.max_tokens={max_tokens}"
        )
    if du.k1_min >= max_tokens:
        raise ValueError(
            f"algorithm.duet.k1_min={du.k1_min} must be below generation.max_tokens="
            f"{max_tokens}: the marker would never be polled after the first K1 refit"
        )
    gate = int(0.7 * max_tokens) + du.grace
    if gate >= max_tokens:
        warnings.warn(
            f"algorithm.duet.grace: the cold abort gate K2 + grace = {gate} is not below "
            f"generation.max_tokens={max_tokens}; no rollout is aborted before K2 is refit",
            stacklevel=3,
        )


def duet_controller(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of the controller's `DuetController` for the run (allocation, per-prompt
    state, K1/K2 window)."""
    du = cfg.algorithm.duet
    return {
        "b": du.b,
        "max_len": cfg.generation.max_tokens,
        "n_ref": du.n_ref,
        "n_min": du.n_min,
        "n_max": du.n_max,
        "eps_pre": du.eps_pre,
        "k_warmup": du.k_warmup,
        "s_floor": du.s_floor,
        "floor_min": du.floor_min,
        "length_window": du.length_window,
        "refit_every": du.refit_every,
        "k1_min": du.k1_min,
        "k2_gap": du.k2_gap,
        "allocate": du.allocate,
    }


def duet_stop(cfg: Config, k1: int, k2: int, step: int) -> dict[str, Any] | None:
    """Settings of one step's `StopControllerFactory` (all but the decode function and the
    request sizes, which the GeneratorActor supplies); None when the `early_stop` ablation
    is off, so no stop rule runs in the engine."""
    du = cfg.algorithm.duet
    if not du.early_stop:
        return None
    return {
        "k1": k1,
        "k2": k2,
        "base_seed": cfg.run.seed,
        "step": step,
        "domain": du.domain,
        "grace": du.grace,
        "eps_abort": du.eps_abort,
        "poll_every": du.poll_every,
        "window": du.marker_window,
    }
