"""Tandem's hooks in the step loop: co-written rollouts, senior-only shaping, tandem validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rlvr.config import Config
from rlvr.generation.base import SamplingParams
from rlvr.methods.base import Method, StepServices, register
from rlvr.methods.tandem.config import TandemConfig, check_tandem
from rlvr.methods.tandem.shaping import junior_dir, shape_tandem
from rlvr.tasks.base import Problem
from rlvr.training.batch import TrainBatch
from rlvr.training.rollouts import Rollouts


@register("tandem")
class Tandem(Method):
    """Tandem RL (arXiv:2606.28166, Algorithm 1): a frozen junior co-writes every rollout at word
    boundaries (Sec. 3.3), only the senior's tokens train (Sec. 3.4, Eq. 1); best checkpoint by
    the accuracy of tandem rollouts (Sec. 5.1)."""

    section = TandemConfig
    engine_state = True  # the author schedule, read by a logits processor in the engine
    single_turn = "the junior co-writes one completion, switching authors at word boundaries"
    best_metric = "eval_tandem_accuracy"

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        check_tandem(cfg)

    def generator_settings(self, model_dir: Path) -> dict[str, Any]:
        t = self.cfg.algorithm.tandem
        return {
            "tandem": {
                "junior_path": str(junior_dir(self.cfg, model_dir)),
                "p": t.p,
                "cap": t.cap,
                "junior": t.junior,
            }
        }

    def companion_engine(self) -> bool:
        return self.cfg.algorithm.tandem.junior == "separate"

    def companion_settings(self, model_dir: Path) -> dict[str, Any]:
        """The junior's own engine: the junior's weights, writing the junior's segments."""
        t = self.cfg.algorithm.tandem
        return {
            "model_path": str(junior_dir(self.cfg, model_dir)),
            "tandem": {"p": t.p, "cap": t.cap, "role": "junior"},
        }

    def rollout_options(self, plan: dict[str, Any], step: int) -> dict[str, Any]:
        return {"tandem": True}

    def shape(
        self, run: StepServices, rollouts: Rollouts, plan: dict[str, Any], step: int
    ) -> tuple[TrainBatch, dict[str, Any]]:

        return shape_tandem(rollouts, self.cfg, pad_id=run.tokenizer.pad_token_id)

    def evaluate(
        self, run: StepServices, problems: list[Problem], params: SamplingParams, step: int
    ) -> dict[str, float]:
        """Accuracy of tandem rollouts (the junior co-writing as in training, eval sampling)."""
        n = {p.id: self.cfg.generation.eval_samples for p in problems}
        rollouts = run.generate(problems, n, params, step, tandem=True)
        run.verify(rollouts)
        return {
            "eval_tandem_accuracy": float(np.mean(rollouts.rewards >= 1.0)),
            "eval_tandem_length_mean": float(np.mean(rollouts.lengths)),
        }
