"""The comparison methods of the CSA paper (arXiv:2605.20270: Sec. 3.2 and Table 1, evaluated in
Sec. 6 and App. F.8), vectorised over R synchronous streams. Settings the paper does not give follow
the authors' code (github.com/HamedKhosravi99/CSA-Code).

Every method has one small interface: `decide(scores [R]) -> release [R]`, then `observe(passed [R])`
with that round's verifier labels; `threshold [R]` is the gate in force (NaN = abstain on all, inf =
release all). `BASELINES` builds any of them by name for the bench and the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
from scipy import stats

from rlvr.algorithms.csa import CSABatch

# The offline baselines and NEX-Conf search this grid in the authors' code, not CSA's grid.
PAPER_GRID = np.linspace(0.01, 0.99, 15)


class SelectiveMethod(Protocol):
    """A release rule run on R synchronous streams: decide a round, then absorb its labels."""

    name: str
    threshold: np.ndarray

    def decide(self, scores: np.ndarray) -> np.ndarray: ...

    def observe(self, passed: np.ndarray) -> None: ...


def _largest_valid(grid: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per row of `valid [R, G]`, the largest grid value marked valid, NaN if none."""
    top = grid.size - 1 - np.argmax(valid[:, ::-1], axis=1)
    return np.where(valid.any(axis=1), grid[top], np.nan)


class _Gate:
    """Release iff score <= threshold (NaN never releases); subclasses move the threshold."""

    name = "gate"

    def __init__(self, n_streams: int, threshold: float):
        self.threshold = np.full(n_streams, float(threshold))
        self._scores = np.zeros(n_streams)

    def decide(self, scores: np.ndarray) -> np.ndarray:
        """Release flags `[R]`: score <= the current threshold."""
        self._scores = np.asarray(scores, dtype=np.float64)
        return self._scores <= self.threshold

    def observe(self, passed: np.ndarray) -> None:
        """A fixed gate learns nothing from labels."""


class AlwaysAct(_Gate):
    """Release everything: its risk is the base failure rate. No guarantee."""

    name = "Always-Act"

    def __init__(self, n_streams: int):
        super().__init__(n_streams, math.inf)


class FixedThreshold(_Gate):
    """Release iff s <= q (0.5 in the paper), never updated. No guarantee."""

    name = "Fixed"

    def __init__(self, n_streams: int, q: float = 0.5):
        super().__init__(n_streams, q)


class NaiveTuning(_Gate):
    """Every `every` rounds, once more than `min_acts` releases: step q down if the running selective
    risk exceeds alpha + band, up if it is below alpha - band. No guarantee."""

    name = "Naive-Tuning"

    def __init__(
        self,
        n_streams: int,
        alpha: float,
        q0: float = 0.5,
        step: float = 0.02,
        every: int = 20,
        min_acts: int = 5,
        band: float = 0.02,
    ):
        super().__init__(n_streams, q0)
        self.alpha, self.step, self.every, self.min_acts, self.band = (
            alpha,
            step,
            every,
            min_acts,
            band,
        )
        self._acts = np.zeros(n_streams, dtype=np.int64)
        self._fails = np.zeros(n_streams, dtype=np.int64)
        self._t = 0

    def observe(self, passed: np.ndarray) -> None:
        """Count this round, and retune every `every` rounds."""
        acted = self._scores <= self.threshold
        self._acts += acted
        self._fails += acted & ~np.asarray(passed, dtype=bool)
        self._t += 1
        if self._t % self.every:
            return
        risk = self._fails / np.maximum(self._acts, 1)
        ready = self._acts > self.min_acts
        move = np.where(risk > self.alpha + self.band, -self.step, 0.0)
        move = np.where(risk < self.alpha - self.band, self.step, move)
        self.threshold = np.clip(self.threshold + np.where(ready, move, 0.0), 0.0, 1.0)


def _aci_step(
    q: np.ndarray, acted: np.ndarray, fail: np.ndarray, alpha: float, gamma: float | np.ndarray
) -> np.ndarray:
    """ACI threshold update: + gamma(alpha - err) on released rounds, + gamma alpha/2 otherwise."""
    return q + np.where(acted, gamma * (alpha - fail), gamma * alpha / 2)


class ACI(_Gate):
    """Adaptive conformal inference (Gibbs and Candes 2021) on the threshold; long-run average only."""

    name = "ACI"

    def __init__(
        self,
        n_streams: int,
        alpha: float,
        gamma: float = 0.01,
        q0: float = 0.3,
        bounds: tuple[float, float] = (0.01, 0.99),
    ):
        super().__init__(n_streams, q0)
        self.alpha, self.gamma, self.bounds = alpha, gamma, bounds

    def observe(self, passed: np.ndarray) -> None:
        """One ACI step per stream."""
        acted = self._scores <= self.threshold
        fail = (~np.asarray(passed, dtype=bool)).astype(np.float64)
        self.threshold = np.clip(
            _aci_step(self.threshold, acted, fail, self.alpha, self.gamma), *self.bounds
        )


class SAOCP(_Gate):
    """Six ACI experts (gamma_k = 0.002 * 2^k) mixed by exponential weights (Bhatnagar 2023).

    The deployed threshold is the weighted mean of the experts' thresholds; an expert's loss is
    1 - alpha if its own gate released a failure, 0 if it released a pass, alpha/2 if it abstained.
    """

    name = "SAOCP"

    def __init__(
        self,
        n_streams: int,
        alpha: float,
        gammas: Sequence[float] = tuple(0.002 * 2**k for k in range(6)),
        eta: float = 0.05,
        q0: float = 0.3,
        bounds: tuple[float, float] = (0.01, 0.99),
    ):
        super().__init__(n_streams, q0)
        self.alpha, self.eta, self.bounds = alpha, eta, bounds
        self.gammas = np.asarray(gammas, dtype=np.float64)
        self.expert_q = np.full((n_streams, self.gammas.size), float(q0))
        self.weights = np.full((n_streams, self.gammas.size), 1.0 / self.gammas.size)

    def observe(self, passed: np.ndarray) -> None:
        """Reweight the experts on their own losses, then step each expert's ACI."""
        fail = (~np.asarray(passed, dtype=bool)).astype(np.float64)[:, None]
        acted = self._scores[:, None] <= self.expert_q
        loss = np.where(acted, fail * (1 - self.alpha), self.alpha / 2)
        w = self.weights * np.exp(-self.eta * loss)
        self.weights = w / w.sum(axis=1, keepdims=True)
        self.expert_q = np.clip(
            _aci_step(self.expert_q, acted, fail, self.alpha, self.gammas), *self.bounds
        )
        self.threshold = (self.weights * self.expert_q).sum(axis=1)


class NEXConf(_Gate):
    """Non-exchangeable conformal (Barber 2023) as in the paper: over the last `window` rounds with
    weights decay^age, the largest grid threshold whose weighted selective failure rate is <= alpha.
    Abstains during the first `warmup` rounds; when no threshold qualifies it keeps the previous one,
    as the authors' code does. Valid at each fixed time only, not simultaneously."""

    name = "NEX-Conf"

    def __init__(
        self,
        n_streams: int,
        alpha: float,
        grid: Sequence[float] | np.ndarray = PAPER_GRID,
        window: int = 500,
        decay: float = 0.99,
        warmup: int = 50,
    ):
        super().__init__(n_streams, math.nan)
        self.alpha, self.window, self.decay, self.warmup = alpha, window, decay, warmup
        self.grid = np.asarray(grid, dtype=np.float64)
        shape = (n_streams, self.grid.size)
        # Weighted sums kept incrementally: decay both, add the newest, drop the one leaving.
        self._fail_mass = np.zeros(shape)
        self._gate_mass = np.zeros(shape)
        self._ring_gated = np.zeros((window, *shape), dtype=bool)
        self._ring_fail = np.zeros((window, n_streams), dtype=bool)
        self._count = 0

    def decide(self, scores: np.ndarray) -> np.ndarray:
        """Gate with the threshold implied by the current window."""
        if self._count >= self.warmup:
            # A weight is at least decay^(window-1), so 1e-12 only filters float residue of zero.
            valid = (self._gate_mass > 1e-12) & (self._fail_mass <= self.alpha * self._gate_mass)
            self.threshold = np.where(
                valid.any(axis=1), _largest_valid(self.grid, valid), self.threshold
            )
        return super().decide(scores)

    def observe(self, passed: np.ndarray) -> None:
        """Slide the window by one round."""
        gated = self._scores[:, None] <= self.grid[None, :]
        failed = gated & ~np.asarray(passed, dtype=bool)[:, None]
        self._fail_mass *= self.decay
        self._gate_mass *= self.decay
        slot = self._count % self.window
        if self._count >= self.window:
            old_w = self.decay**self.window
            old_gated = self._ring_gated[slot]
            self._gate_mass -= old_w * old_gated
            self._fail_mass -= old_w * (old_gated & self._ring_fail[slot][:, None])
        self._fail_mass += failed
        self._gate_mass += gated
        self._ring_gated[slot] = gated
        self._ring_fail[slot] = ~np.asarray(passed, dtype=bool)
        self._count += 1


# The authors' code skips thresholds gating fewer than 10 prefix items in every bound but CRC's
# conformal one.
def _bound_hoeffding(n, k, alpha, delta, g):
    return (n >= 10) & (
        k / np.maximum(n, 1) + np.sqrt(math.log(g / delta) / (2 * np.maximum(n, 1))) <= alpha
    )


def _bound_conformal(n, k, alpha, delta, g):
    return (k + 1) / (n + 1) <= alpha


def _bound_hoeffding_bentkus(n, k, alpha, delta, g):
    r_hat = k / np.maximum(n, 1)
    hoeffding = np.exp(-2 * n * np.maximum(alpha - r_hat, 0.0) ** 2)
    bentkus = math.e * stats.binom.cdf(k, n, alpha)
    return (n >= 10) & (np.minimum(hoeffding, bentkus) <= delta / g)


def _bound_clopper_pearson(n, k, alpha, delta, g):
    with np.errstate(invalid="ignore"):
        upper = stats.beta.ppf(1 - delta / g, k + 1, n - k)
    return (n >= 10) & (n > k) & (np.nan_to_num(upper, nan=1.0) <= alpha)


# bound(n [R,G], k [R,G], alpha, delta, grid size) -> valid [R,G]
LOCKED_BOUNDS: dict[str, Callable[..., np.ndarray]] = {
    "hoeffding": _bound_hoeffding,
    "conformal": _bound_conformal,
    "hoeffding_bentkus": _bound_hoeffding_bentkus,
    "clopper_pearson": _bound_clopper_pearson,
}


class LockedThreshold(_Gate):
    """Offline calibration on the first `n_cal` rounds (abstaining meanwhile), then a locked gate:
    the largest grid threshold whose prefix selective risk passes `bound`, or refusal forever.
    Fixed-horizon and exchangeable guarantees only. CRC, LTT and ConfFact differ in the bound."""

    name = "locked"

    def __init__(
        self,
        n_streams: int,
        alpha: float,
        delta: float,
        bound: str,
        grid: Sequence[float] | np.ndarray = PAPER_GRID,
        n_cal: int = 500,
    ):
        if bound not in LOCKED_BOUNDS:
            raise ValueError(f"unknown bound {bound!r}; choose one of {sorted(LOCKED_BOUNDS)}")
        super().__init__(n_streams, math.nan)
        self.alpha, self.delta, self.bound, self.n_cal = alpha, delta, bound, n_cal
        self.grid = np.asarray(grid, dtype=np.float64)
        self._n = np.zeros((n_streams, self.grid.size), dtype=np.int64)
        self._k = np.zeros((n_streams, self.grid.size), dtype=np.int64)
        self._t = 0

    def observe(self, passed: np.ndarray) -> None:
        """Accumulate the prefix; lock the threshold once it is complete."""
        if self._t >= self.n_cal:
            return
        gated = self._scores[:, None] <= self.grid[None, :]
        self._n += gated
        self._k += gated & ~np.asarray(passed, dtype=bool)[:, None]
        self._t += 1
        if self._t == self.n_cal:
            valid = LOCKED_BOUNDS[self.bound](
                self._n, self._k, self.alpha, self.delta, self.grid.size
            )
            self.threshold = _largest_valid(self.grid, valid)


class CRC(LockedThreshold):
    """Conformal risk control (Angelopoulos 2024). Main tables (the authors' code):
    r_hat + sqrt(log(G/delta)/2n) <= alpha ("hoeffding"); the shift cells used
    (n r_hat + 1)/(n + 1) <= alpha ("conformal")."""

    name = "CRC"

    def __init__(self, n_streams: int, alpha: float, delta: float, bound: str = "hoeffding", **kw):
        super().__init__(n_streams, alpha, delta, bound, **kw)


class LTT(LockedThreshold):
    """Learn-then-test (Angelopoulos 2022): Hoeffding-Bentkus p-value <= delta/G with n >= 10."""

    name = "LTT"

    def __init__(self, n_streams: int, alpha: float, delta: float, **kw):
        super().__init__(n_streams, alpha, delta, "hoeffding_bentkus", **kw)


class ConfFact(LockedThreshold):
    """Conformal factuality (Mohri and Hashimoto 2024): Clopper-Pearson upper bound at level
    1 - delta/G <= alpha."""

    name = "ConfFact"

    def __init__(self, n_streams: int, alpha: float, delta: float, **kw):
        super().__init__(n_streams, alpha, delta, "clopper_pearson", **kw)


def marginal_eprocess(
    n_streams: int, alpha: float, delta: float, grid: Sequence[float] | np.ndarray
) -> CSABatch:
    """A-RCPS-style baseline: CSA's e-processes on the marginal increment A(q)(1 - V) - alpha.

    It certifies thresholds whose marginal risk AR * R^act is below alpha, which does not bound the
    selective risk R^act among released answers (App. F.8)."""
    return CSABatch(n_streams, alpha, delta, grid, increment="marginal")


# name -> factory(n_streams, alpha, delta, csa_grid); csa_grid matters only where CSA's grid is shared.
BASELINES: dict[str, Callable[[int, float, float, np.ndarray], SelectiveMethod]] = {
    "always": lambda r, a, d, g: AlwaysAct(r),
    "fixed": lambda r, a, d, g: FixedThreshold(r),
    "naive": lambda r, a, d, g: NaiveTuning(r, a),
    "aci": lambda r, a, d, g: ACI(r, a),
    "saocp": lambda r, a, d, g: SAOCP(r, a),
    "nex": lambda r, a, d, g: NEXConf(r, a),
    "crc": lambda r, a, d, g: CRC(r, a, d),
    "ltt": lambda r, a, d, g: LTT(r, a, d),
    "conffact": lambda r, a, d, g: ConfFact(r, a, d),
    "marginal": marginal_eprocess,
}
