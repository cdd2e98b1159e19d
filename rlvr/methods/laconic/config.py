"""LACONIC's section of the training config (`algorithm.laconic`), its checks across sections
and the dual variable it gives the controller."""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import Field, model_validator

from rlvr.algorithms import laconic
from rlvr.config import Config, Section


class LaconicConfig(Section):
    """LACONIC: keep the mean response length under `budget` tokens with an adaptive dual."""

    budget: int | None = Field(
        None, gt=0, description="Target mean response length B (tokens); required by LACONIC."
    )
    eta: float = Field(
        laconic.DEFAULT_ETA, ge=0.0, description="Dual step size (0 = fixed lambda, an ablation)."
    )
    lam_max: float | Literal["auto"] = Field(
        laconic.DEFAULT_LAM_MAX,
        description="Ceiling of the dual variable; 'auto' = the safe ceiling B / (max_tokens - B).",
    )
    lam_init: float = Field(laconic.DEFAULT_LAM_INIT, ge=0.0, description="Initial dual value.")
    cost: Literal["hinge", "linear"] = Field(
        "hinge",
        description="'hinge' = max(L/B - 1, 0) (the method); 'linear' = L/B - 1 (ablation).",
    )

    @model_validator(mode="after")
    def _check(self) -> LaconicConfig:
        if isinstance(self.lam_max, float) and self.lam_max < 0:
            raise ValueError("lam_max must be >= 0 or 'auto'")
        return self


def check_laconic(cfg: Config) -> None:
    """The budget must exist and be reachable: below `generation.max_tokens`."""
    lc, max_tokens = cfg.algorithm.laconic, cfg.generation.max_tokens
    if lc.budget is None:
        raise ValueError("algorithm.laconic.budget is required by LACONIC")
    if lc.budget >= max_tokens:
        raise ValueError(
            f"algorithm.laconic.budget={lc.budget} must be below generation.max_tokens="
            f"{max_tokens}: no response can exceed it, so it never constrains anything"
        )
    _, warning = laconic.resolve_lam_max(lc.lam_max, lc.budget, max_tokens)
    if warning:
        warnings.warn(f"algorithm.laconic.lam_max: {warning}", stacklevel=2)


def laconic_dual(cfg: Config) -> dict[str, float]:
    """Keyword arguments of the controller's `laconic.DualState` for the run."""
    lc = cfg.algorithm.laconic
    lam_max, _ = laconic.resolve_lam_max(lc.lam_max, lc.budget, cfg.generation.max_tokens)
    return {"budget": lc.budget, "eta": lc.eta, "lam_max": lam_max, "lam": lc.lam_init}
