"""Deterministic prompt order: the batch of step s is a pure function of (seed, s).

Each epoch is a fresh seeded permutation of the pool; because nothing is stateful, a resumed run
draws exactly the prompts an uninterrupted run would.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


class PromptSampler(Generic[T]):
    """Batches of `batch_size` items, epoch after epoch, each epoch shuffled with (seed, epoch)."""

    def __init__(self, items: list[T], batch_size: int, seed: int):
        if not items:
            raise ValueError("the prompt pool is empty")
        if batch_size <= 0:
            raise ValueError("batch_size must be positive")
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {
                epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.items))
            }
        return self._orders[epoch]

    def batch(self, step: int) -> list[T]:
        """Items of 0-based step `step`."""
        n = len(self.items)
        out = []
        start = step * self.batch_size
        for pos in range(start, start + self.batch_size):
            epoch, idx = divmod(pos, n)
            out.append(self.items[int(self._epoch_order(epoch)[idx])])
        return out

    def epoch_of(self, step: int) -> int:
        return step * self.batch_size // len(self.items)
