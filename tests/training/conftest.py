"""Fixtures shared by the trainer tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rlvr.training.batch import TrainBatch
from rlvr.training.policy_trainer import PolicyTrainer

StepWithGrads = Callable[[PolicyTrainer, TrainBatch], tuple[dict, dict[str, torch.Tensor]]]


def _step_with_grads(
    trainer: PolicyTrainer, batch: TrainBatch
) -> tuple[dict, dict[str, torch.Tensor]]:
    from deepspeed.utils import safe_get_full_grad

    engine = trainer.engine
    grads: dict[str, torch.Tensor] = {}
    step = engine.step

    def capture_then_step() -> None:
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                grads[name] = safe_get_full_grad(p).to("cpu", copy=True)
        step()

    engine.step = capture_then_step
    try:
        metrics = trainer.train_step(batch)
    finally:
        engine.step = step
    return metrics, grads


@pytest.fixture
def step_with_grads() -> StepWithGrads:
    """One train step's metrics and every trainable parameter's full gradient before the
    optimizer step, on the CPU whatever the trainer's device (`safe_get_full_grad` reassembles
    ZeRO-1/2 partitions and ZeRO-3 shards)."""
    return _step_with_grads
