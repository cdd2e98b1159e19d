"""The surrogate-Brier early-reset diagnostic of CSA-Epoch (arXiv:2605.20270, App. B.5, "Deployment
recipe for the multi-epoch variant", item (iii b)).

The paper: "a sustained Brier increase of >20% over the warmup baseline is a leading indicator that
the frontier may have dropped and an early epoch reset is warranted", monitored "over a sliding
window". It fixes neither the window, the warm-up nor "sustained"; `BrierMonitor` is our reading,
decided from F_{t-1} information only so that a reset stays predictable (Assumption 4.2).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any


class BrierMonitor:
    """Sustained rise of the calibrated score's Brier score over its warm-up baseline (App. B.5).

    Each labelled round contributes b = (s - f)^2, the squared error of the calibrated score s (an
    estimate of P(fail), Sec. 4.2) against the verifier's failure indicator f = 1 - V. Our reading
    of the paper's loose terms, with W = `window` and rho = `threshold`:

    - warm-up baseline B0: the mean of b over the first W labelled rounds the monitor sees (per
      epoch: the owner resets it at every epoch start, so each epoch's score map and policy set
      their own baseline; one baseline for the whole stream would fire again right after every
      reset that a lasting shift caused);
    - sliding window: the mean B_t of b over the last W labelled rounds;
    - sustained rise of more than rho: B_t > (1 + rho) B0 at each of W consecutive labelled rounds
      after the warm-up, i.e. the rise outlasts a full turnover of the window that first crossed.
      One dip at or below the bar restarts the count. So the earliest alarm comes 2W labels into
      an epoch. With B0 = 0 any positive window mean counts as a rise.

    W = 500 by default (the paper's retraining batch B, and half its shortest recommended epoch):
    on calibrated scores s ~ U(0, 1) (Brier 1/6) our simulation saw 0-1% of 200 streams alarm
    falsely within 3000 rounds, against 9% with W = 200 (whose baseline is too noisy for a 20%
    bar), and a rise to Brier 1/4 (+50%) alarmed in every stream, 500-1200 rounds after it began.

    Only labels the owner has applied (seq order) reach `update`, so the alarm, and the epoch
    boundary it moves, is predictable. Means are `math.fsum` over the stored window, so a
    restored monitor continues bit-identically.
    """

    def __init__(self, window: int = 500, threshold: float = 0.2):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"the Brier window must be a positive number of rounds, got {window}")
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"the Brier threshold must be a positive fraction, got {threshold}")
        self.window = window
        self.threshold = float(threshold)
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next W labels form a new warm-up baseline."""
        self._values: deque[float] = deque(maxlen=self.window)
        self._baseline: float | None = None
        self._run = 0

    def update(self, score: float, failed: bool) -> bool:
        """Absorb one applied label; True when the rise has now been sustained for W rounds."""
        self._values.append((float(score) - float(failed)) ** 2)
        if self._baseline is None:
            if len(self._values) == self.window:
                self._baseline = math.fsum(self._values) / self.window
            return False
        if self.window_brier > (1.0 + self.threshold) * self._baseline:
            self._run += 1
        else:
            self._run = 0
        return self._run >= self.window

    @property
    def baseline(self) -> float | None:
        """Warm-up Brier B0 (None while warming up)."""
        return self._baseline

    @property
    def window_brier(self) -> float | None:
        """Mean Brier over the last W labels (over those seen, while warming up; None: none)."""
        return math.fsum(self._values) / len(self._values) if self._values else None

    def view(self) -> dict[str, Any]:
        """Monitoring read-out: baseline, current window mean, bar and consecutive rounds above."""
        bar = None if self._baseline is None else (1.0 + self.threshold) * self._baseline
        return {
            "baseline": self._baseline,
            "window_brier": self.window_brier,
            "bar": bar,
            "rounds_above": self._run,
            "labels": len(self._values),
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-plain state (floats round-trip exactly through `json`)."""
        return {"values": list(self._values), "baseline": self._baseline, "run": self._run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict` for a monitor with the same window and threshold."""
        values = [float(v) for v in state["values"]]
        if len(values) > self.window:
            raise ValueError(f"{len(values)} stored Brier values exceed the window {self.window}")
        self._values = deque(values, maxlen=self.window)
        self._baseline = None if state["baseline"] is None else float(state["baseline"])
        self._run = int(state["run"])
