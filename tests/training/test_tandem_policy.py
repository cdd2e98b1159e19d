"""Tandem training through the actor classes (in-process, no Ray): the senior-only update that
Tandem's shaping makes of a co-written batch (bit-identical to GRPO at p = 1 and to GRPO with the
junior's tokens masked out, loud without an authorship mask), and a GeneratorActor whose junior stays bit-identical over DeepSpeed
steps and syncs (the vLLM engine's junior is checked in tests/generation, away from DeepSpeed:
closing the last in-process vLLM engine tears down the process group DeepSpeed keeps using)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.generator import GeneratorActor
from actors.policy import PolicyActor
from rlvr.algorithms.tandem import SwitchCounters
from rlvr.config import load_config
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.generation.tandem_support import counters_to_dict
from rlvr.methods.grpo.shaping import shape_grpo
from rlvr.methods.tandem.shaping import shape_tandem
from rlvr.models.tiny import build_tiny_model
from rlvr.training.rollouts import Rollouts

POLICY = {"threads": 1, "zero_stage": 0, "lr": 1e-2, "micro_batch_size": 4, "seed": 0}
PROMPTS = [[3, 4, 5], [3, 4, 5], [6, 7], [6, 7]]
RESPONSES = [[11, 12, 13, 14], [15, 16], [17, 18, 19], [20, 21, 22, 23, 24]]
REWARDS = [1.0, 0.0, 0.0, 1.0]
MIXED = [[1, 0, 0, 1], [0, 1], [1, 1, 0], [0, 0, 1, 1, 0]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _rollouts(authorships):
    rollouts = Rollouts(
        group_ids=["a", "a", "b", "b"],
        prompt_ids=PROMPTS,
        response_ids=RESPONSES,
        texts=[""] * 4,
        golds=[""] * 4,
        finish_reasons=["length"] * 4,
        flags=[{"tandem": counters_to_dict(SwitchCounters(2, 1, 1))} for _ in range(4)],
        rewards=np.array(REWARDS),
    )
    rollouts.authorships = authorships
    return rollouts


def _step(model_dir, batch):
    policy = PolicyActor(str(model_dir), **POLICY)
    metrics = policy.train_step(batch)
    return metrics, policy.export_weights()


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_p_one_update_is_bit_identical_to_grpo(model_dir):
    cfg = load_config(None, ["algorithm.name=tandem"])
    tandem_batch, stats = shape_tandem(_rollouts([[1] * len(r) for r in RESPONSES]), cfg, 0)
    grpo_batch, _ = shape_grpo(_rollouts([None] * 4), cfg, 0)
    assert torch.equal(tandem_batch.response_mask, grpo_batch.response_mask)
    assert stats["tandem/senior_token_frac"] == 1.0
    tandem_metrics, tandem_weights = _step(model_dir, tandem_batch)
    grpo_metrics, grpo_weights = _step(model_dir, grpo_batch)
    assert tandem_metrics == grpo_metrics
    _assert_same_weights(tandem_weights, grpo_weights)


def test_the_update_is_grpo_on_the_senior_tokens_alone(model_dir):
    cfg = load_config(None, ["algorithm.name=tandem"])
    batch, stats = shape_tandem(_rollouts(MIXED), cfg, 0)
    assert stats["tandem/senior_token_frac"] == 7 / 14
    assert batch.num_loss_tokens == 7
    # The same rollouts as plain GRPO whose loss mask drops the junior's tokens by hand.
    masked, _ = shape_grpo(_rollouts([None] * 4), cfg, 0)
    for row, (prompt, flags) in enumerate(zip(PROMPTS, MIXED, strict=True)):
        masked.response_mask[row, len(prompt) : len(prompt) + len(flags)] = torch.tensor(flags) == 1
    # Junior tokens count neither in the loss nor in the token-mean denominator.
    full, _ = shape_grpo(_rollouts([None] * 4), cfg, 0)
    tandem_metrics, tandem_weights = _step(model_dir, batch)
    masked_metrics, masked_weights = _step(model_dir, masked)
    full_metrics, full_weights = _step(model_dir, full)
    assert tandem_metrics == masked_metrics
    assert tandem_metrics["tokens"] == 7 and full_metrics["tokens"] == 14
    _assert_same_weights(tandem_weights, masked_weights)
    assert any(not torch.equal(tandem_weights[n], full_weights[n]) for n in full_weights)


def test_tandem_shaping_refuses_rollouts_without_authorship():
    """The senior's mask is made once, in Tandem's shaping; rollouts that lost their authorship
    stop the step there instead of training as plain GRPO."""
    cfg = load_config(None, ["algorithm.name=tandem"])
    with pytest.raises(ValueError, match="carry no authorship"):
        shape_tandem(_rollouts([None] * 4), cfg, 0)


def _train_and_sync(generator, policy, steps):
    """`steps` Tandem steps: co-write, shape, senior-only update, sync the senior."""
    cfg = load_config(None, ["algorithm.name=tandem"])
    params = SamplingParams(temperature=1.0, max_tokens=12)
    for step in range(steps):
        requests = [
            GenerationRequest(prompt, n=4, request_id=str(i), seed=100 * step + 10 * i)
            for i, prompt in enumerate([[5, 6, 7], [40, 41]])
        ]
        results = generator.generate(requests, params, tandem=True)
        rollouts = Rollouts.from_results(results, {"0": "", "1": ""})
        rollouts.rewards = np.array([float(k % 2) for k in range(len(rollouts))])
        batch, stats = shape_tandem(rollouts, cfg, pad_id=0)
        assert 0.0 < stats["tandem/senior_token_frac"] < 1.0
        policy.train_step(batch)
        generator.update_weights(policy.export_weights())


def test_the_hf_generators_junior_stays_bit_identical_over_steps_and_syncs(model_dir):
    generator = GeneratorActor(
        "hf", str(model_dir), threads=1, tandem={"junior_path": str(model_dir), "p": 0.5, "cap": 8}
    )
    policy = PolicyActor(str(model_dir), **POLICY)
    _train_and_sync(generator, policy, steps=3)
    base = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    junior = dict(generator.backend.junior.named_parameters())
    senior = dict(generator.backend.model.named_parameters())
    assert junior.keys() == base.keys()
    assert all(torch.equal(junior[n], base[n]) for n in base)
    assert not all(torch.equal(senior[n], base[n]) for n in base)
    assert generator.weight_version == 3
