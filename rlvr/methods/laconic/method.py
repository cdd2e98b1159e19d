"""LACONIC's hooks in the step loop: the Lagrangian reward and the once-per-step dual update."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlvr.algorithms import laconic
from rlvr.config import Config
from rlvr.methods.base import ControllerState, Method, StepServices, register
from rlvr.methods.grpo.shaping import shape_grpo
from rlvr.methods.laconic.config import LaconicConfig, check_laconic, laconic_dual
from rlvr.methods.laconic.state import LaconicState
from rlvr.training.batch import TrainBatch
from rlvr.training.rollouts import Rollouts


@register("laconic")
class Laconic(Method):
    """LACONIC (Liu et al., "LACONIC: Length-Aware Constrained Reinforcement Learning for LLM",
    Algorithm 1): GRPO on the Lagrangian reward r - lambda * c(L) (Eqs. 6-8) with an adaptive
    dual lambda (Eq. 9), read once per step from the controller before any advantage."""

    section = LaconicConfig

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        check_laconic(cfg)

    def controller_state(self) -> ControllerState:
        return LaconicState(**laconic_dual(self.cfg))

    def shape(
        self, run: StepServices, rollouts: Rollouts, plan: dict[str, Any], step: int
    ) -> tuple[TrainBatch, dict[str, Any]]:
        lc, lam = self.cfg.algorithm.laconic, plan["laconic_lambda"]
        lengths = np.asarray(rollouts.lengths)
        shaped = laconic.lagrangian_rewards(rollouts.rewards, lengths, lc.budget, lam, lc.cost)
        batch, stats = shape_grpo(
            rollouts, self.cfg, pad_id=run.tokenizer.pad_token_id, rewards=shaped
        )
        # the dual sees every response the step trains on (those whose rewards were computed)
        lam_next = run.update_method_state(step, mean_length=float(lengths.mean()))
        truncated = [f == "length" for f in rollouts.finish_reasons]
        stats.update(
            laconic.step_metrics(
                rollouts.rewards, lengths, truncated, lc.budget, lam, lam_next, lc.cost
            )
        )
        return batch, stats
