"""One DRO step on the actors with the tiny model and the keyword judge: R3 read on the rollout
weights before the sync, rubric gates, the DRO loss, its metrics; the GeneratorActor (vLLM prompt
log-probs) and the PolicyActor (forward pass) score alike; the held-out validation reward."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from rlvr.algorithms import dro
from rlvr.config import load_config
from rlvr.generation import make_backend
from rlvr.methods.dro.rollouts import scoring_inputs
from rlvr.run.rundir import RunDir
from workflows.components import policy_kwargs, start_components
from workflows.train import Trainer, best_metric, prepare

# The integration suite's tiny task and sizes (tests/integration/conftest.py), so the SFT
# warm-up is shared with its runs.
OVERRIDES = [
    "task.n_test=16",
    "generation.prompts_per_step=4",
    "generation.group_size=4",
    "generation.max_tokens=24",
    "resources.num_verifiers=1",
    "algorithm.dro.omega=1.0",
    # each group's prompt runs once in training, in token-budget packs
    "training.shared_prefix=true",
    "training.micro_batch_tokens=256",
]


@pytest.fixture(scope="module")
def dro_step_run(ray_cluster, tiny_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("dro")
    cfg = load_config(
        tiny_config.parent / "tiny-dro.yaml",
        [*OVERRIDES, f"algorithm.dro.rubrics_path={out / 'rubrics.json'}", f"run.output_dir={out}"],
    )
    model_dir, train, test = prepare(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    comps = start_components(cfg, model_dir)
    try:
        run = RunDir(out / "run")
        run.create(cfg.to_dict())
        trainer = Trainer(cfg, run, comps, tokenizer, train, test, model_dir=model_dir)
        step = trainer.method
        metrics = trainer.step(0)
        rollouts = trainer._last_rollouts
        inputs = scoring_inputs(rollouts, step.references, step.tokens)
        # after the step both actors hold the updated policy: score the same ids on each
        by_generator = comps.generator.run("score_logprobs", inputs.sequences, inputs.positions)
        by_policy = comps.policy.run("score_logprobs", inputs.sequences, inputs.positions)
        trainer.evaluate(0)  # into out/run/eval.jsonl
        yield cfg, model_dir, metrics, rollouts, inputs, by_generator, by_policy, out
    finally:
        comps.shutdown()


def test_generator_and_policy_scoring_agree(dro_step_run):
    *_, inputs, by_generator, by_policy, _ = dro_step_run
    assert len(by_generator) == len(inputs.sequences) == 16
    for g, p in zip(by_generator, by_policy, strict=True):
        np.testing.assert_allclose(g, p, atol=1e-4)


def test_rewards_are_r3_of_the_rollout_weights(dro_step_run):
    """Step 0's rollouts came from the initial model: R3 recomputed from it (a transformers
    forward of the same token ids) equals the logged rewards, so scoring preceded the sync."""
    cfg, model_dir, metrics, rollouts, inputs, *_ = dro_step_run
    reference = make_backend("hf", model_dir, dtype="float32")
    logps = reference.score_logprobs(inputs.sequences, inputs.positions)
    for start in range(0, 16, 4):
        rows = np.asarray(logps[start : start + 4])
        expected = dro.r3_rewards(np.exp(rows), omega=1.0)
        np.testing.assert_allclose(rollouts.rewards[start : start + 4], expected, atol=1e-4)
    assert metrics["reward_mean"] == pytest.approx(rollouts.rewards.mean())
    # R3 is a softmax-weighted mean of probabilities clipped to [0.05, 0.85]; the weights sum to 1
    # only up to rounding, so the mean can pass a bound by a few ulps (0.8500000000000001 seen).
    assert rollouts.rewards.min() >= 0.05 - 1e-12 and rollouts.rewards.max() <= 0.85 + 1e-12


def test_gates_loss_and_metrics(dro_step_run):
    cfg, _, metrics, rollouts, *_, out = dro_step_run
    assert metrics["dro_groups"] == 4
    accepted = 4 - metrics["dro_groups_rejected"]
    assert metrics["dro_reject_rate"] == metrics["dro_reject_rate_cum"] == 1 - accepted / 4
    assert metrics["dro_train_sequences"] == 4 * accepted
    for key in ("dro_prob_mean", "dro_sbar_mean", "dro_exact_accuracy", "time_dro_score"):
        assert key in metrics
    assert 0 < metrics["dro_prob_mean"] < 1 and metrics["dro_sbar_mean"] >= 0
    assert (
        metrics["dro_coverage_failures"] + metrics["dro_consistency_failures"]
        >= (metrics["dro_groups_rejected"])
    )
    # keyword rubrics: one item per value in the reference, e.g. 'The response contains "7".'
    cache = json.loads((out / "rubrics.json").read_text())["rubrics"]
    assert len(cache) == cfg.task.n_train
    assert all(r["items"][0].startswith('The response contains "') for r in cache.values())
    statuses = set(rollouts.statuses)
    assert statuses <= {"accepted", "no_coverage", "no_consistency"}
    if metrics["dro_trained_rollouts"]:
        # at ratio 1 the loss value can cancel within a group; the gradient does not
        assert "train_entropy_threshold" in metrics and metrics["train_grad_norm"] > 0.0
    else:
        assert metrics["train_skipped"] == 1
    settings = policy_kwargs(cfg, out)["settings"]
    assert (settings.loss, settings.kl_coef, settings.loss_options) == (
        "dro",
        0.001,
        {"rho_ent": 0.4},
    )


def test_evaluate_reports_the_validation_reward_that_selects(dro_step_run):
    """Held-out mean R3 over groups of training-sampled rollouts picks DRO's best checkpoint."""
    cfg, *_, out = dro_step_run
    [record] = RunDir(out / "run").read_eval()
    assert record["best_metric"] == best_metric(cfg) == "eval_r3"
    d = cfg.algorithm.dro
    assert d.clip_low <= record["eval_r3"] <= d.clip_high
    assert 0 < record["eval_ref_prob"] < 1
    assert 0 <= record["eval_accuracy"] <= 1 and record["eval_samples"] == 1
