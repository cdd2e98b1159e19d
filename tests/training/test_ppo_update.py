"""The trainer's PPO update against hand-computed values, through the DeepSpeed micro-batch loop:
tempered log-probs, the clipped ratio on later optimizer steps, the aggregated k3 KL, the engine
importance correction and the learning-rate schedule (with exact resume).
"""

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlvr.models.tiny import build_tiny_model
from rlvr.training.batch import TrainBatch, build_batch, token_entropy, token_logprobs
from rlvr.training.policy_trainer import LrLambda, PolicyTrainer

# Positive advantages on rows 0 and 3, negative on rows 1 and 2: a large step moves the former's
# ratios above 1 + clip_high and the latter's below 1 - clip_low.
PROMPTS = [[3, 4, 5], [3, 4], [6, 7, 8, 9], [10]]
RESPONSES = [[11, 12, 13], [14, 21], [15, 16], [17, 18, 19, 20]]
ADVANTAGES = [1.0, -1.0, -0.5, 2.0]
BASE = {"zero_stage": 2, "lr": 0.05, "micro_batch_size": 2, "seed": 0, "grad_clip": 1e6}
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# At this lr one Adam step moves the ratios to 0.72-0.82 on the negative rows and 1.22-1.54 on the
# positive ones: some tokens past each clip bound, some inside (the nearest is 0.003 from 0.8).
CLIP_LR = 6e-5
# fp32 forwards of the same weights in micro-batches of different padding agree to ~1e-6; the
# losses below are means of O(1) terms, so 1e-5 separates a wrong formula from float noise.
TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def make_batch() -> TrainBatch:
    batch = build_batch(PROMPTS, RESPONSES, pad_id=0)
    batch.advantages = torch.tensor(ADVANTAGES)
    return batch


def aggregate(token_values: torch.Tensor, mask: torch.Tensor, agg: str) -> float:
    """The three loss aggregations written out by hand (max_len = the longest response, 4)."""
    rows = [token_values[i][mask[i]].tolist() for i in range(len(mask))]
    if agg == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if agg == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) / 4 for r in rows) / len(rows)


def hand_ppo(ratio: torch.Tensor, agg: str, clip: float = 0.2) -> tuple[float, float, float]:
    """PPO-clip loss, clip_frac_low and clip_frac_high of `ratio` against ADVANTAGES."""
    mask = make_batch().response_mask
    adv = torch.tensor(ADVANTAGES, dtype=torch.float64)[:, None].expand_as(ratio)
    r = ratio.double()
    unclipped, clipped = -adv * r, -adv * r.clamp(1 - clip, 1 + clip)
    loss = aggregate(torch.maximum(unclipped, clipped), mask, agg)
    active = (clipped > unclipped) & mask
    n = int(mask.sum())
    return loss, float((active & (r < 1)).sum()) / n, float((active & (r > 1)).sum()) / n


def test_logprobs_and_entropy_are_of_the_tempered_distribution(model_dir):
    trainer = PolicyTrainer(model_dir, **BASE, temperature=0.7)
    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    valid = batch.attention_mask.bool()
    valid[:, 0] = False
    want = torch.log_softmax(logits[:, :-1] / 0.7, dim=-1).gather(-1, batch.input_ids[:, 1:, None])
    torch.testing.assert_close(trainer.logprobs(batch)[valid], want[..., 0][valid[:, 1:]])
    assert not torch.allclose(
        token_logprobs(logits, batch.input_ids)[valid], want[..., 0][valid[:, 1:]]
    )
    p = torch.softmax(logits[:, :-1] / 0.7, dim=-1)
    entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(token_entropy(logits, 0.7)[:, 1:], entropy)
    # DRO's R3 scoring stays at temperature 1 whatever the sampling temperature.
    sequences = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    positions = [list(range(1, len(s))) for s in sequences]
    scored = trainer.sequence_logprobs(sequences, positions)
    raw = token_logprobs(logits, batch.input_ids)
    for i, pos in enumerate(positions):
        torch.testing.assert_close(torch.tensor(scored[i]), raw[i, pos], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        PolicyTrainer(model_dir, **BASE, temperature=0.0)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_clipping_engages_on_the_second_update(model_dir, agg):
    """epochs=2: the first update is on-policy (ratio 1, nothing clipped); the second sees the
    ratio of the once-updated policy to pi_old, which the test computes from a twin trainer that
    took the same first step (runs are bitwise reproducible)."""
    batch = make_batch()
    mask = batch.response_mask
    twin = PolicyTrainer(model_dir, **{**BASE, "lr": CLIP_LR}, loss_agg=agg)
    old = twin.logprobs(batch)
    twin.train_step(make_batch())
    ratio = torch.where(mask, torch.exp(twin.logprobs(batch) - old), torch.ones_like(old))
    want_loss, want_low, want_high = hand_ppo(ratio, agg)
    assert want_low > 0 and want_high > 0 and want_low + want_high < 1, "a mix on both sides"

    trainer = PolicyTrainer(model_dir, **{**BASE, "lr": CLIP_LR}, loss_agg=agg, epochs=2)
    out = trainer.train_step(make_batch())
    first, second = out["updates"]
    at_one, _, _ = hand_ppo(torch.ones_like(ratio), agg)
    assert first["pg_loss"] == pytest.approx(at_one, abs=TOL)
    assert first["clip_frac"] == pytest.approx(0.0, abs=TOL)
    assert second["pg_loss"] == pytest.approx(want_loss, abs=TOL)
    # clip flags are counts over 11 tokens: exact unless a ratio sits within float noise of a bound
    assert second["clip_frac_low"] == pytest.approx(want_low, abs=TOL)
    assert second["clip_frac_high"] == pytest.approx(want_high, abs=TOL)
    assert second["clip_frac"] == pytest.approx(want_low + want_high, abs=TOL)
    approx_kl = float(torch.where(mask, -ratio.log(), 0.0).sum() / mask.sum())
    assert second["approx_kl"] == pytest.approx(approx_kl, abs=TOL)
    assert out["optimizer_steps"] == 2
    assert out["clip_frac_high"] == pytest.approx(want_high / 2, abs=TOL)  # mean over updates


def test_mini_batches_step_on_slices_against_one_old_policy(model_dir):
    trainer = PolicyTrainer(model_dir, **BASE, mini_batches=2)
    before = trainer.logprobs(make_batch())
    out = trainer.train_step(make_batch(), logprob_sums=True)
    first, second = out["updates"]
    assert out["optimizer_steps"] == 2 and trainer.steps == 2
    assert first["tokens"] == 5 and second["tokens"] == 6  # rows 0-1, then rows 2-3
    assert first["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    # rows 2-3 are scored against pi_old after the policy moved on rows 0-1
    assert abs(second["approx_kl"]) > 1e-4
    mask = make_batch().response_mask
    want = torch.where(mask, before, 0.0).sum(dim=1).tolist()
    assert out["logprob_sums"] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_kl_is_aggregated_like_the_policy_loss(model_dir, agg):
    batch = make_batch()
    trainer = PolicyTrainer(model_dir, **BASE, loss_agg=agg, kl_coef=0.1)
    logp = trainer.logprobs(batch)
    # a reference that differs per token by -0.3 .. 0.6 (k3 = e^d - d - 1 with d = ref - logp)
    shift = torch.linspace(-0.3, 0.6, logp.numel()).reshape(logp.shape)
    batch.ref_logp = logp + shift
    out = trainer.train_step(batch)
    k3 = shift.double().exp() - shift.double() - 1
    assert out["kl"] == pytest.approx(aggregate(k3, batch.response_mask, agg), abs=TOL)
    at_one, _, _ = hand_ppo(torch.ones_like(logp), agg)
    assert out["loss"] == pytest.approx(at_one + 0.1 * out["kl"], abs=TOL)


@pytest.mark.parametrize("mode", ["off", "tis", "mask"])
def test_engine_importance_weights_enter_the_loss(model_dir, mode):
    batch = make_batch()
    trainer = PolicyTrainer(model_dir, **BASE, engine_is=mode, engine_is_cap=2.0)
    logp = trainer.logprobs(batch)
    mask = batch.response_mask
    # engine/trainer ratio rho = exp(old - rollout): 0.5 on row 0, 3 (past the cap) on row 3,
    # 1 elsewhere; the last token of row 2 was forced by a stop rule (log-prob exactly 0, flagged
    # in `forced`), and one token of row 1 the engine drew from a one-token nucleus (log-prob
    # exactly 0 too, not flagged): only the flag leaves a token unweighted.
    rho = torch.ones_like(logp)
    rho[0], rho[3] = 0.5, 3.0
    forced = (2, int(mask[2].nonzero()[-1]))
    certain = (1, int(mask[1].nonzero()[0]))
    rho[certain] = logp[certain].exp()  # rollout log-prob 0: rho = pi_old / 1
    batch.rollout_logp = torch.where(mask, logp - rho.log(), torch.zeros_like(logp))
    batch.rollout_logp[forced] = 0.0
    batch.rollout_logp[certain] = 0.0
    batch.forced = torch.zeros_like(mask)
    batch.forced[forced] = True
    out = trainer.train_step(batch)
    compared = mask.clone()
    compared[forced] = False
    if mode == "tis":
        weights = rho.clamp(max=2.0)
    elif mode == "mask":
        weights = (rho <= 2.0).float()
    else:
        weights = torch.ones_like(rho)
    weights[forced] = 1.0
    adv = torch.tensor(ADVANTAGES)[:, None].expand_as(logp)
    assert out["pg_loss"] == pytest.approx(aggregate(-adv * weights, mask, "token-mean"), abs=TOL)
    # measured whatever the mode: the old-policy forward and rollout_logp agree to ~1e-6
    rho_c = rho[compared]
    assert out["engine_ratio_mean"] == pytest.approx(float(rho_c.mean()), rel=1e-5)
    assert out["engine_ratio_max"] == pytest.approx(3.0, rel=1e-5)
    assert out["engine_capped_frac"] == pytest.approx(float((rho_c > 2).float().mean()), abs=TOL)
    assert out["engine_kl"] == pytest.approx(float(-rho_c.log().mean()), abs=TOL)


def test_engine_importance_weights_leave_the_kl_term_unweighted(model_dir):
    """TIS corrects the policy-gradient estimate for the engine having sampled the tokens; the
    KL to the reference is a penalty on pi_theta itself and keeps its plain mean (verl, OpenRLHF)."""
    batch = make_batch()
    trainer = PolicyTrainer(model_dir, **BASE, engine_is="tis", engine_is_cap=2.0, kl_coef=0.1)
    logp = trainer.logprobs(batch)
    mask = batch.response_mask
    rho = torch.ones_like(logp)
    rho[0], rho[3] = 0.5, 1.8
    batch.rollout_logp = torch.where(mask, logp - rho.log(), torch.zeros_like(logp))
    shift = torch.linspace(-0.3, 0.6, logp.numel()).reshape(logp.shape)
    batch.ref_logp = logp + shift
    out = trainer.train_step(batch)
    k3 = shift.double().exp() - shift.double() - 1
    unweighted = aggregate(k3, mask, "token-mean")
    assert abs(aggregate(k3 * rho, mask, "token-mean") - unweighted) > 100 * TOL
    assert out["kl"] == pytest.approx(unweighted, abs=TOL)
    adv = torch.tensor(ADVANTAGES)[:, None].expand_as(logp)
    assert out["pg_loss"] == pytest.approx(aggregate(-adv * rho, mask, "token-mean"), abs=TOL)
    assert out["loss"] == pytest.approx(out["pg_loss"] + 0.1 * unweighted, abs=TOL)


def test_lr_schedules_by_hand():
    constant = LrLambda("constant", warmup=4)
    assert [constant(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = LrLambda("linear", warmup=2, total=6, min_ratio=0.2)
    # after warm-up: progress 0, 1/4, 2/4, 3/4 of the 4 decay steps, then held at the floor
    assert [linear(k) for k in range(8)] == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    cosine = LrLambda("cosine", warmup=0, total=4)
    want = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert [cosine(k) for k in range(5)] == pytest.approx(want)
    with pytest.raises(ValueError, match="total steps"):
        LrLambda("cosine", warmup=4, total=4)


def test_lr_schedule_is_saved_and_resumed_exactly(model_dir, tmp_path):
    settings = {**BASE, "lr_schedule": "cosine", "warmup_steps": 1, "total_steps": 4}
    straight = PolicyTrainer(model_dir, **settings)
    lrs = [straight.train_step(make_batch())["lr"] for _ in range(3)]
    assert lrs == pytest.approx([0.05, 0.05, 0.05 * 0.5 * (1 + math.cos(math.pi / 3))])

    first = PolicyTrainer(model_dir, **settings)
    first.train_step(make_batch())
    first.save_state(tmp_path / "state")
    resumed = PolicyTrainer(model_dir, **settings)
    resumed.load_state(tmp_path / "state")
    assert [resumed.train_step(make_batch())["lr"] for _ in range(2)] == lrs[1:]
    batch = make_batch()
    assert torch.equal(resumed.logprobs(batch), straight.logprobs(batch))
