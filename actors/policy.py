"""PolicyActor: owns the DeepSpeed-wrapped policy (`rlvr.training.PolicyTrainer`).

A thin shell: it sets the process's threads, builds the trainer once and forwards calls. On CPU it
is one gloo process; on GPUs one actor per rank in a placement group. With Tandem on, every
training batch must carry its authorship and only the senior's tokens enter the loss.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from rlvr.algorithms.tandem import senior_loss_mask
from rlvr.config import LoraConfig
from rlvr.training.batch import TrainBatch


class PolicyActor:
    def __init__(
        self,
        model_path: str,
        threads: int,
        lora: dict[str, Any] | None = None,
        tandem: bool = False,
        **trainer_kwargs: Any,
    ):
        torch.set_num_threads(threads)
        self.tandem = tandem
        from rlvr.training.policy_trainer import PolicyTrainer

        self.trainer = PolicyTrainer(
            model_path, lora=LoraConfig(**lora) if lora else None, **trainer_kwargs
        )

    def ready(self) -> bool:
        return True

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.trainer.logprobs(batch)

    def score_logprobs(
        self, sequences: list[list[int]], positions: list[list[int]]
    ) -> list[list[float]]:
        return self.trainer.sequence_logprobs(sequences, positions)

    def train_step(self, batch: TrainBatch, logprob_sums: bool = False) -> dict[str, Any]:
        """One optimizer step; in Tandem mode on the senior's tokens only (token-mean over
        them), raising if the batch lost its authorship (a silent fallback would be plain GRPO)."""
        if self.tandem:
            mask = senior_loss_mask(batch.response_mask, batch.authorship)
            batch = replace(batch, response_mask=mask)
        return self.trainer.train_step(batch, logprob_sums=logprob_sums)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.export_weights()

    def save_state(self, directory: str) -> None:
        self.trainer.save_state(directory)

    def load_state(self, directory: str) -> None:
        self.trainer.load_state(directory)

    def save_model(self, directory: str) -> str:
        """HF-format checkpoint (merged weights, plus the PEFT adapter when LoRA is on)."""
        self.trainer.save_checkpoint(directory)
        return str(Path(directory))
