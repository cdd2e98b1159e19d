"""The learner-side R3 scoring pass (`PolicyTrainer.sequence_logprobs`) equals the naive loop."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlvr.models.tiny import build_tiny_model
from rlvr.training.policy_trainer import PolicyTrainer

SEQUENCES = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [100, 7, 300, 12, 55, 81, 243, 17, 2]]
POSITIONS = [[3, 4, 5], [1, 2], [6, 7, 8]]


def test_sequence_logprobs_match_prefix_forwards(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    trainer = PolicyTrainer(model_dir, zero_stage=0, micro_batch_size=2)
    got = trainer.sequence_logprobs(SEQUENCES, POSITIONS)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for seq, pos, row in zip(SEQUENCES, POSITIONS, got, strict=True):
            expected = [
                torch.log_softmax(model(torch.tensor([seq[:t]])).logits[0, -1], -1)[seq[t]].item()
                for t in pos
            ]
            assert row == pytest.approx(expected, abs=1e-5)
