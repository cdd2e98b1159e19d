"""The engine importance weight compares like with like: pi_old within the sampler's top-p
nucleus against the engine's log-probs of the distribution it sampled from.

Rollouts come from the transformers backend, the engines' reference sampler, with the trainer's
own fp32 weights at T 0.9 / top-p 0.95. Each token's log-prob then differs only by fp32 kernel
order (incremental decoding with a KV cache against one full forward, and the nucleus mass
summed in another order): ~1e-6 nats, so the mean ratio and the KL sit within 1e-4 of 1 and 0
(a 100x margin). Over the full tempered softmax the ratio would instead be the nucleus mass,
~0.95 on the tiny model's flat distributions.
"""

from pathlib import Path

import pytest
import torch

from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.generation.hf_backend import HFBackend
from rlvr.models.tiny import build_tiny_model
from rlvr.training.batch import TrainBatch
from rlvr.training.engine_mismatch import results_batch
from rlvr.training.policy_trainer import PolicyTrainer

TEMPERATURE, TOP_P = 0.9, 0.95
TOL = 1e-4
BASE = {"zero_stage": 0, "lr": 1e-3, "micro_batch_size": 4, "seed": 0, "temperature": TEMPERATURE}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def batch(model_dir: Path) -> TrainBatch:
    engine = HFBackend(model_dir)
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=24, seed=5)
    results = engine.generate([GenerationRequest(p, n=4) for p in prompts], params)
    out = results_batch(results, engine.pad_token_id)
    out.advantages = torch.linspace(-1.0, 1.0, len(out))
    return out


@pytest.mark.parametrize(
    "settings",
    [
        {},  # the full-logits forward, on-policy: the training forward's own nucleus
        {"lm_head_chunk": 16},  # the fused head's chunks
        {"shared_prefix": True},  # packed prompts, one head chunk
        {"mini_batches": 2, "engine_is": "tis"},  # the old-policy pass, kept for both updates
    ],
    ids=["logits", "fused-head", "shared-prefix", "old-pass"],
)
def test_identical_weights_give_a_ratio_of_one(model_dir, batch, settings):
    trainer = PolicyTrainer(model_dir, **{**BASE, "top_p": TOP_P, **settings})
    out = trainer.train_step(batch)
    assert out["engine_ratio_mean"] == pytest.approx(1.0, abs=TOL)
    assert out["engine_ratio_max"] == pytest.approx(1.0, abs=TOL)
    assert abs(out["engine_kl"]) < TOL
    assert out["engine_outside_frac"] == 0.0


def test_the_full_softmax_would_read_the_nucleus_mass_as_a_mismatch(model_dir, batch):
    """What the ratio measured before it replayed the nucleus: the nucleus mass, all below 1."""
    out = PolicyTrainer(model_dir, **BASE).train_step(batch)  # top_p 1: no truncation replayed
    assert TOP_P - TOL < out["engine_ratio_mean"] < 0.99
    assert out["engine_ratio_max"] < 1.0 + TOL
    assert out["engine_kl"] > 0.01


def test_old_log_probs_given_without_their_nucleus_are_refused(model_dir, batch):
    trainer = PolicyTrainer(model_dir, **{**BASE, "top_p": TOP_P, "engine_is": "tis"})
    given = TrainBatch(**{**batch.__dict__, "old_logp": trainer.logprobs(batch)})
    with pytest.raises(ValueError, match="old_nucleus_logp"):
        trainer.train_step(given)
