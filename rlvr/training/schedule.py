"""The learning-rate schedule of the policy's optimizer: linear warm-up, then constant, linear or
cosine decay to a floor (as TRL and verl schedule GRPO)."""

from __future__ import annotations

import math
from typing import Literal

LrSchedule = Literal["constant", "linear", "cosine"]


class LrLambda:
    """The lr multiplier of optimizer step k (0-based): a linear warm-up to 1 over ``warmup``
    steps, then constant, or a linear / cosine decay to ``min_ratio`` at step ``total``.

    A class rather than a lambda so that DeepSpeed can pickle it with the scheduler's state.
    """

    def __init__(
        self,
        schedule: LrSchedule = "constant",
        warmup: int = 0,
        total: int | None = None,
        min_ratio: float = 0.0,
    ) -> None:
        if schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr schedule {schedule!r}")
        if warmup < 0 or not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"warmup={warmup} must be >= 0 and min_ratio={min_ratio} in [0, 1]")
        if schedule != "constant" and (total is None or total <= warmup):
            raise ValueError(
                f"a {schedule} lr schedule needs total steps above the warm-up ({warmup}), got {total}"
            )
        self.schedule, self.warmup, self.total, self.min_ratio = schedule, warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / (self.total - self.warmup))
        if self.schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * decay
