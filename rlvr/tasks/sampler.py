"""Deterministic prompt order: the batch of step s is a pure function of (seed, s).

The pool is read as one stream of epochs, each a seeded permutation of every item, cut into
consecutive batches. A batch that straddles the end of epoch e takes the rest of epoch e, then
fills up from epoch e + 1 skipping the items it already holds; the skipped items move to just
after that fill, so epoch e + 1 still draws every item exactly once, and no step ever holds the
same item twice (their rollouts would share a prompt id and merge into one group). Where no
straddling batch would repeat an item, the stream is the plain concatenation of the permutations.
Nothing is stateful, so a resumed run draws exactly the prompts an uninterrupted run would.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


class PromptSampler(Generic[T]):
    """Batches of `batch_size` distinct items, epoch after epoch, each epoch shuffled with
    (seed, epoch) and then adjusted only where a straddling batch would repeat an item.

    Epoch e occupies the positions [e * n, (e + 1) * n) of the stream (n items in the pool), so
    every item is drawn once per epoch; a step belongs to the epoch of its first item
    (`epoch_of`). The pool must hold at least `batch_size` items.
    """

    def __init__(self, items: list[T], batch_size: int, seed: int):
        if not items:
            raise ValueError("the prompt pool is empty")
        if batch_size <= 0:
            raise ValueError("batch_size must be positive")
        if len(items) < batch_size:
            raise ValueError(
                f"the prompt pool holds {len(items)} items, fewer than batch_size={batch_size}: "
                f"a step cannot hold {batch_size} distinct prompts"
            )
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}
        """Adjusted orders of the last epochs built (a batch reads at most two)."""

    def _next_order(self, epoch: int, previous: np.ndarray) -> np.ndarray:
        """Order of `epoch` given the order of `epoch - 1`: the seeded permutation, with the
        first items the straddling batch needs moved ahead of those it already holds."""
        n, size = len(self.items), self.batch_size
        perm = self._permutation(epoch)
        tail = (epoch * n) % size  # items of epoch - 1 in the batch straddling the boundary
        if tail == 0:
            return perm
        fresh = np.flatnonzero(~np.isin(perm, previous[n - tail :]))[: size - tail]
        rest = np.ones(n, dtype=bool)
        rest[fresh] = False
        return np.concatenate([perm[fresh], perm[rest]])

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Adjusted order of `epoch`, built forward from the nearest epoch known without its
        predecessor: a cached one, one whose start is not inside a batch (its plain permutation),
        or one after an epoch whose tail the adjustment cannot reach (n - tail >= batch_size:
        only its first batch_size positions move). With n >= 2 * batch_size - 1 that is always
        the previous epoch; smaller pools walk back at most batch_size epochs."""
        n, size = len(self.items), self.batch_size
        e = epoch
        while e not in self._orders and (e * n) % size and n - (e * n) % size < size:
            e -= 1
        if e in self._orders:
            order = self._orders[e]
        elif (e * n) % size == 0:
            order = self._permutation(e)
        else:
            order = self._next_order(e, self._permutation(e - 1))
        exact = {e: order}
        while e < epoch:
            e, order = e + 1, self._next_order(e + 1, order)
            exact[e] = order
        self._orders = {k: exact[k] for k in (epoch - 1, epoch) if k in exact}
        return order

    def _permutation(self, epoch: int) -> np.ndarray:
        """The seeded shuffle of `epoch`, before any adjustment."""
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def batch(self, step: int) -> list[T]:
        """Items of 0-based step `step`, all distinct."""
        n, size = len(self.items), self.batch_size
        epoch, start = divmod(step * size, n)
        order = self._epoch_order(epoch)[start : start + size]
        if len(order) < size:
            order = np.concatenate([order, self._epoch_order(epoch + 1)[: size - len(order)]])
        return [self.items[int(i)] for i in order]

    def epoch_of(self, step: int) -> int:
        """Epoch of the step's first item; the step ends its epoch iff `epoch_of(step + 1)` is
        larger (it holds that epoch's last item)."""
        return step * self.batch_size // len(self.items)
