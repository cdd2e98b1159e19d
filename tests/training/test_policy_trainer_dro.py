"""PolicyTrainer's DRO loss (arXiv:2506.13351, Eq. 3 and App. F.2) through DeepSpeed: the same
gradient as `dro.dro_loss` on the whole batch, Dr.GRPO's normaliser shared by micro-batches,
truncated rows counted but not trained, the KL to the frozen reference, and the 80/20 threshold
reported."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlvr.algorithms import dro
from rlvr.models.tiny import build_tiny_model
from rlvr.training.batch import TrainBatch, build_batch, token_entropy, token_logprobs
from rlvr.training.policy_trainer import PolicyTrainer

PROMPTS = [[3, 4, 5], [3, 4], [6, 7, 8, 9], [10]]
RESPONSES = [[11, 12, 13], [14], [15, 16], [17, 18, 19, 20]]
ADVANTAGES = [1.0, -1.0, 0.5, 2.0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def make_batch(truncated_last: bool = False) -> TrainBatch:
    masks = [[True] * len(r) for r in RESPONSES]
    if truncated_last:
        masks[-1] = [False] * len(RESPONSES[-1])
    batch = build_batch(PROMPTS, RESPONSES, pad_id=0, loss_masks=masks)
    batch.advantages = torch.tensor(ADVANTAGES)
    return batch


def make_trainer(model_dir: Path, **kw) -> PolicyTrainer:
    # max_response_len: Dr.GRPO's constant normaliser (the generation budget in a run)
    settings = {"zero_stage": 0, "lr": 1e-3, "grad_clip": 1e6, "seed": 0, "loss": "dro"}
    settings["max_response_len"] = 4
    if "rho_ent" in kw:
        settings["loss_options"] = {"rho_ent": kw.pop("rho_ent")}
    return PolicyTrainer(model_dir, **{**settings, **kw})


@pytest.mark.parametrize(("truncated", "expected"), [(False, -11 / 16), (True, -3 / 16)])
def test_loss_at_ratio_one_and_micro_batch_invariance(
    model_dir, step_with_grads, truncated, expected
):
    """rho_ent=1 trains every token: loss = -sum_i A_i |o_i| / (N * max_len) with N = 4 rows
    (a truncated row counts) and max_len = 4; micro-batches share that normaliser."""
    runs = [
        step_with_grads(
            make_trainer(model_dir, micro_batch_size=m, rho_ent=1.0), make_batch(truncated)
        )
        for m in (1, 3)
    ]
    (m1, g1), (m3, g3) = runs
    assert m1["loss"] == pytest.approx(expected, abs=1e-6)
    assert m3["loss"] == pytest.approx(expected, abs=1e-6)
    assert m1["clip_frac"] == 0.0 and m1["kl"] == 0.0
    for name in g1:
        torch.testing.assert_close(g1[name], g3[name], rtol=1e-4, atol=1e-7)


def test_gradient_equals_dro_loss_with_the_entropy_mask(model_dir, step_with_grads):
    """One micro-batch: the engine's gradient is that of `dro.dro_loss` on a plain model."""
    batch = make_batch()
    metrics, grads = step_with_grads(
        make_trainer(model_dir, micro_batch_size=8, rho_ent=0.4), batch
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logprobs(logits, batch.input_ids)
    entropy = token_entropy(logits)
    loss, stats = dro.dro_loss(
        logp,
        logp.detach(),
        batch.advantages,
        batch.response_mask,
        entropy=entropy,
        beta=0.0,
        rho_ent=0.4,
        max_len=4,
    )
    loss.backward()
    assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert metrics["entropy_threshold"] == pytest.approx(
        float(stats["entropy_threshold"]), rel=1e-5
    )
    assert 0 < stats["pg_token_frac"] < 1  # ceil(0.4 * 10) = 4 of 10 tokens get PG
    params = dict(model.named_parameters())
    for name, g in grads.items():
        torch.testing.assert_close(g, params[name].grad, rtol=1e-4, atol=1e-7)


def test_entropy_cut_is_the_whole_batch_s_whatever_the_micro_batches(model_dir, step_with_grads):
    """The 80/20 cut is taken over every loss token of the step (gathered across ranks), so
    micro-batches of 1 or 8 rows give the same threshold, loss and gradient."""
    runs = [
        step_with_grads(make_trainer(model_dir, micro_batch_size=m, rho_ent=0.4), make_batch())
        for m in (1, 8)
    ]
    (m1, g1), (m8, g8) = runs
    # the same entropies, computed in batches of 1 and of 8 rows: bit-equal on CPU, a few ulps
    # apart on a GPU (kernels picked by shape); a cut per micro-batch would be orders further off
    assert m1["entropy_threshold"] == pytest.approx(m8["entropy_threshold"], rel=1e-6)
    assert m1["loss"] == pytest.approx(m8["loss"], abs=1e-6)
    # fp32 sums over 1 vs 8 padded rows: an element near 0 can differ by ~2e-7
    for name in g1:
        torch.testing.assert_close(g1[name], g8[name], rtol=1e-4, atol=1e-6)


def test_chunked_lm_head_gives_the_same_cut_loss_and_gradient(model_dir, step_with_grads):
    """Entropies from the head applied at loss tokens in chunks (lse - sum p * logit) round
    differently from the full logits' -sum p log p, by ~1e-7: the same tokens pass the cut."""
    full, chunked = (
        step_with_grads(
            make_trainer(model_dir, micro_batch_size=8, rho_ent=0.4, lm_head_chunk=chunk),
            make_batch(),
        )
        for chunk in (0, 5)
    )
    assert chunked[0]["entropy_threshold"] == pytest.approx(full[0]["entropy_threshold"], rel=1e-5)
    assert chunked[0]["loss"] == pytest.approx(full[0]["loss"], abs=1e-6)
    for name in full[1]:
        torch.testing.assert_close(chunked[1][name], full[1][name], rtol=1e-4, atol=1e-6)


def test_kl_to_the_frozen_reference(model_dir):
    trainer = make_trainer(model_dir, micro_batch_size=2, kl_coef=0.1, lr=5e-2)
    first = trainer.train_step(make_batch())
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # the policy still is the reference
    second = trainer.train_step(make_batch())
    assert second["kl"] > 0.0


def test_every_update_cuts_on_the_old_policy_s_entropies(model_dir):
    """With two mini-batches over two epochs, each update applies the 80/20 cut to pi_old's
    entropies (the pass before the first update), not to the entropies of the policy it has
    become: the share of tokens it keeps is that of the old entropies in every update, though a
    large step moves the entropies in between."""
    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    entropy = token_entropy(logits)
    mask = batch.response_mask
    threshold = dro.entropy_threshold(entropy[mask], 0.4)
    halves = ([0, 1], [2, 3])  # mini-batch rows; every update has each half's 4 or 6 tokens
    kept = [float((entropy[rows][mask[rows]] >= threshold).float().mean()) for rows in halves]
    trainer = make_trainer(
        model_dir, micro_batch_size=2, rho_ent=0.4, lr=0.5, mini_batches=2, epochs=2
    )
    out = trainer.train_step(batch)
    assert out["entropy_threshold"] == pytest.approx(float(threshold), rel=1e-5)
    shares = [u["pg_token_frac"] for u in out["updates"]]
    assert shares == pytest.approx(kept + kept, abs=1e-6)
    with torch.no_grad():  # the step did move the entropies: a fresh cut would differ
        model.load_state_dict(trainer.export_weights(), strict=False)
        moved = token_entropy(model(input_ids=batch.input_ids).logits)
    assert float((moved - entropy)[mask].abs().max()) > 0.1
