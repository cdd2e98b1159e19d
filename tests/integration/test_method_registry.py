"""A method added from outside the project, written entirely in this module: its own config
section with a check, a dual variable kept on the controller, and a policy loss of its own, all
registered by name, run through the actors (vLLM engine, DeepSpeed policy, verifier pool,
controller) with no change elsewhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from pydantic import Field
from transformers import AutoTokenizer

from rlvr.config import Config, ConfigError, Section, load_config
from rlvr.generation.base import SamplingParams
from rlvr.methods.base import Method, StepServices, register
from rlvr.run.rundir import RunDir
from rlvr.tasks.base import Problem
from rlvr.training.batch import TrainBatch
from rlvr.training.losses import LossContext, grpo_loss, register_policy_loss
from rlvr.training.rollouts import Rollouts
from workflows.components import start_components
from workflows.train import Trainer, best_metric, prepare

PENALTY = 0.01


class BrevityToyConfig(Section):
    """The toy's parameters: a mean length budget and the step size of its dual."""

    budget: int = Field(8, gt=0, description="Mean response length the dual aims at.")
    eta: float = Field(0.1, ge=0.0, description="Dual step size.")
    lam_init: float = Field(0.5, ge=0.0, description="The dual's first value.")


class BrevityDual:
    """The toy's state on the controller: lambda <- max(0, lambda + eta (mean length / B - 1)),
    once per step; a retried step (plan or update) sees the values it saw the first time."""

    updates_every_step = True

    def __init__(self, budget: int, eta: float, lam: float) -> None:
        self.budget, self.eta, self.lam = budget, eta, lam
        self.before: dict[int, float] = {}  # lambda as each updated step planned with it

    def plan(self, step: int, prompt_ids: list[str]) -> dict[str, Any]:
        return {"toy_lam": self.before.get(step, self.lam)}

    def update(self, step: int, mean_length: float) -> float:
        if step not in self.before:
            self.before[step] = self.lam
            self.lam = max(0.0, self.lam + self.eta * (mean_length / self.budget - 1.0))
        return self.lam if step == max(self.before) else self.before[step + 1]

    def state_dict(self) -> dict[str, Any]:
        return {"lam": self.lam, "before": {str(k): v for k, v in self.before.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lam = state["lam"]
        self.before = {int(k): v for k, v in state["before"].items()}


@register_policy_loss("brevity-toy", metrics=("toy_logp",))
def brevity_loss(ctx: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's loss plus lambda times the token-mean log-prob of the sampled tokens (lambda from
    the method, `TrainBatch.loss_inputs`): a toy term that grows with lambda."""
    loss, stats = grpo_loss(ctx)
    mask = ctx.mask.bool()
    logp = torch.where(mask, ctx.logp, torch.zeros_like(ctx.logp)).sum() / mask.sum().clamp(min=1)
    return loss + ctx.inputs["lam"] * logp, {**stats, "toy_logp": logp.detach()}


@register("brevity_toy")
class BrevityToy(Method):
    """GRPO on the verifier reward minus PENALTY per response token, with its own loss term
    weighted by a dual kept on the controller; validated on brevity."""

    section = BrevityToyConfig
    best_metric = "eval_brevity"
    policy_loss = "brevity-toy"

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        if cfg.algorithm.brevity_toy.budget >= cfg.generation.max_tokens:
            raise ValueError("algorithm.brevity_toy.budget must be below generation.max_tokens")

    def controller_state(self) -> BrevityDual:
        toy = self.cfg.algorithm.brevity_toy
        return BrevityDual(toy.budget, toy.eta, toy.lam_init)

    def score(self, run: StepServices, rollouts: Rollouts, step: int) -> None:
        run.verify(rollouts)
        self.verified = rollouts.rewards.copy()
        rollouts.rewards = rollouts.rewards - PENALTY * np.asarray(rollouts.lengths)

    def shape(
        self, run: StepServices, rollouts: Rollouts, plan: dict[str, Any], step: int
    ) -> tuple[TrainBatch, dict[str, Any]]:
        batch, stats = super().shape(run, rollouts, plan, step)
        batch.loss_inputs = {"lam": plan["toy_lam"]}
        self.planned_lam = plan["toy_lam"]
        return batch, stats

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
        lam = run.update_method_state(step, mean_length=float(np.mean(rollouts.lengths)))
        return {"toy_verified_mean": float(self.verified.mean()), "toy_lam": lam}


def test_an_unregistered_name_fails_at_load():
    with pytest.raises(ConfigError, match=r"algorithm\.name: unknown method 'brevity'"):
        load_config(None, ["algorithm.name=brevity"])


def test_a_registered_toy_method_runs_through_the_actors(ray_cluster, tiny_config, tmp_path):
    cfg = load_config(
        tiny_config,
        [
            "algorithm.name=brevity_toy",
            "algorithm.brevity_toy.budget=6",
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
    # the loss of its own, with the dual the controller planned: GRPO's + lambda * toy_logp
    lam0 = trainer.method.planned_lam
    assert lam0 == 0.5
    assert metrics["train_loss"] == pytest.approx(
        metrics["train_pg_loss"] + lam0 * metrics["train_toy_logp"], abs=1e-6
    )
    # the dual's step on the controller, from the mean length of the step's rollouts
    expected_lam = max(0.0, 0.5 + 0.1 * (float(lengths.mean()) / 6 - 1.0))
    assert metrics["toy_lam"] == pytest.approx(expected_lam)
    assert record["best_metric"] == "eval_brevity" and record["eval_brevity"] < 0


def test_the_toy_s_section_and_check_are_its_own():
    with pytest.raises(ConfigError, match=r"algorithm\.brevity_toy\.budget must be below"):
        load_config(None, ["algorithm.name=brevity_toy", "algorithm.brevity_toy.budget=300"])
    with pytest.raises(ConfigError, match=r"algorithm\.brevity_toy\.eta"):
        load_config(None, ["algorithm.name=brevity_toy", "algorithm.brevity_toy.eta=-1"])
    # under another method the section is still checked by its model, then left out
    with pytest.raises(ConfigError, match=r"algorithm\.brevity_toy\.eta"):
        load_config(None, ["algorithm.brevity_toy.eta=-1"])
    assert (
        "brevity_toy"
        not in load_config(None, ["algorithm.brevity_toy.eta=1"]).to_dict()["algorithm"]
    )
