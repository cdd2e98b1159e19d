"""PolicyTrainer.train_step(logprob_sums=True): DUET's old-policy sequence log-probs come from the
training forward and equal a separate log-prob pass taken before the step."""

from __future__ import annotations

import torch

from rlvr.models.tiny import build_tiny_model
from rlvr.training.batch import build_batch
from rlvr.training.policy_trainer import PolicyTrainer


def test_logprob_sums_are_the_pre_update_policy_over_loss_tokens(tmp_path):
    trainer = PolicyTrainer(
        build_tiny_model(tmp_path / "tiny", seed=0), zero_stage=0, lr=5e-3, micro_batch_size=2
    )
    prompts = [[3, 4, 5], [3, 4], [6, 7, 8, 9]]
    responses = [[11, 12, 13], [14, 15], [15, 16]]
    # the second row is an aborted DUET rollout: no loss tokens, so its sum is 0
    batch = build_batch(prompts, responses, pad_id=0, loss_masks=[[1, 1, 1], [0, 0], [1, 1]])
    batch.advantages = torch.tensor([1.0, 0.0, -1.0])
    before = trainer.logprobs(batch)
    expected = torch.where(batch.response_mask, before, 0.0).sum(dim=1).double()
    out = trainer.train_step(batch, logprob_sums=True)
    assert out["logprob_sums"][1] == 0.0
    assert torch.allclose(
        torch.tensor(out["logprob_sums"], dtype=torch.float64), expected, rtol=0, atol=1e-5
    )
    # the step moved the policy, so a pass after it differs
    after = torch.where(batch.response_mask, trainer.logprobs(batch), 0.0).sum(dim=1)
    assert not torch.allclose(after.double(), expected, atol=1e-5)
    assert "logprob_sums" not in trainer.train_step(batch)
