"""PolicyActor: owns the DeepSpeed-wrapped policy (`rlvr.training.PolicyTrainer`).

A thin shell: it sets the process's threads, builds the trainer once and forwards calls. On CPU it
is one gloo process; on GPUs one actor per rank in a placement group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlvr.config import LoraConfig
from rlvr.training.batch import TrainBatch


class PolicyActor:
    def __init__(
        self,
        model_path: str,
        threads: int,
        lora: dict[str, Any] | None = None,
        **trainer_kwargs: Any,
    ):
        torch.set_num_threads(threads)
        from rlvr.training.policy_trainer import PolicyTrainer

        self.trainer = PolicyTrainer(
            model_path, lora=LoraConfig(**lora) if lora else None, **trainer_kwargs
        )

    def ready(self) -> bool:
        return True

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.trainer.logprobs(batch)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.trainer.train_step(batch)

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
