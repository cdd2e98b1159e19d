"""A method added from outside the project: one `Method` subclass registered by name runs through
the actors (vLLM engine, DeepSpeed policy, verifier pool, controller) with no change elsewhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from rlvr.config import ConfigError, load_config
from rlvr.generation.base import SamplingParams
from rlvr.methods.base import Method, StepServices, register
from rlvr.run.rundir import RunDir
from rlvr.tasks.base import Problem
from rlvr.training.rollouts import Rollouts
from workflows.components import start_components
from workflows.train import Trainer, best_metric, prepare

PENALTY = 0.01


@register("brevity-toy")
class BrevityToy(Method):
    """GRPO on the verifier reward minus PENALTY per response token; validated on brevity."""

    best_metric = "eval_brevity"

    def score(self, run: StepServices, rollouts: Rollouts, step: int) -> None:
        run.verify(rollouts)
        self.verified = rollouts.rewards.copy()
        rollouts.rewards = rollouts.rewards - PENALTY * np.asarray(rollouts.lengths)

    def evaluate(
        self, run: StepServices, problems: list[Problem], params: SamplingParams, step: int
    ) -> dict[str, float]:
        rollouts = run.generate(problems, {p.id: 1 for p in problems}, params, step)
        return {"eval_brevity": -float(np.mean(rollouts.lengths))}

    def observe(
        self,
        run: StepServices,
        rollouts: Rollouts,
        step: int,
        logprob_sums: list[float] | None,
        times: dict[str, float],
    ) -> dict[str, Any]:
        return {"toy_verified_mean": float(self.verified.mean())}


def test_an_unregistered_name_fails_at_load():
    with pytest.raises(ConfigError, match=r"algorithm\.name: unknown method 'brevity'"):
        load_config(None, ["algorithm.name=brevity"])


def test_a_registered_toy_method_runs_through_the_actors(ray_cluster, tiny_config, tmp_path):
    cfg = load_config(
        tiny_config,
        [
            "algorithm.name=brevity-toy",
            "task.n_test=8",
            "generation.prompts_per_step=4",
            "generation.group_size=4",
            "generation.max_tokens=24",
            "resources.num_verifiers=1",
            f"run.output_dir={tmp_path}",
            "run.name=toy",
        ],
    )
    assert best_metric(cfg) == "eval_brevity"
    model_dir, train, test = prepare(cfg)
    comps = start_components(cfg, model_dir)
    try:
        run = RunDir(tmp_path / "toy")
        run.create(cfg.to_dict())
        trainer = Trainer(
            cfg, run, comps, AutoTokenizer.from_pretrained(model_dir), train, test, model_dir
        )
        assert isinstance(trainer.method, BrevityToy)
        metrics = trainer.step(0)
        rollouts = trainer._last_rollouts
        record = trainer.evaluate(0)
    finally:
        comps.shutdown()
    lengths = np.asarray(rollouts.lengths)
    # the step trained on the toy's shaped rewards, and the toy's own hooks reported
    expected = trainer.method.verified - PENALTY * lengths
    np.testing.assert_allclose(rollouts.rewards, expected, rtol=0, atol=1e-12)
    assert metrics["reward_mean"] == pytest.approx(float(expected.mean()), abs=1e-12)
    assert metrics["toy_verified_mean"] == pytest.approx(float(trainer.method.verified.mean()))
    assert metrics["train_rows"] == len(rollouts) and not metrics.get("train_skipped")
    assert record["best_metric"] == "eval_brevity" and record["eval_brevity"] < 0
