"""CSA (Conformal Selective Acting, arXiv:2605.20270): an anytime-valid selective-risk release gate.

One betting e-process per candidate threshold q (Eq. 1) tests "q is unsafe" (failure rate among
rounds with score <= q at least alpha); a threshold is certified for good once its wealth crosses
1/delta_q, and the largest certified threshold gates release (Sec. 4.2-4.3, Algorithms 1 and 2).
`CSAController` is one served stream (reorder buffer, epochs, sparse verification, JSON snapshots);
`CSABatch` runs the same kernel on many synchronous streams at once for tests and the bench.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from rlvr.algorithms.counter_rng import GOLDEN_GAMMA, mix64, unit_float
from rlvr.algorithms.csa.diagnostics import BrierMonitor
from rlvr.algorithms.csa.isotonic import isotonic_knots

GRID_FLOOR = 0.001
GRID_CEILING = 0.8
_STATE_FORMAT = 1
_CONFIG_DEFAULTS = {"drift_budget": 0.0, "brier_window": None, "brier_threshold": 0.2}
"""Configuration keys added after format 1 was written, with the values older snapshots ran under."""


# --------------------------------------------------------------------------- score and calibration


def majority_answer(answers: Sequence[str | None]) -> tuple[str | None, float]:
    """Majority answer of K self-consistency samples and its raw score 1 - agreement (Sec. 4.2).

    `None` marks a sample with no extractable answer: it counts in K but never wins. With no answer
    at all the raw score is 1 (the verifier then labels the round a failure). Ties go to the answer
    seen first, so the choice is deterministic.
    """
    if not answers:
        raise ValueError("majority_answer needs at least one sample")
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None, 1.0
    answer, votes = counts.most_common(1)[0]
    return answer, 1.0 - votes / len(answers)


class Calibrator:
    """Frozen isotonic map g: raw score -> estimated P(fail), fit once on a CAL split (Sec. 4.2,
    App. H).

    Nondecreasing g makes the selective risk E[P(fail|s) | s <= q] nondecreasing in q, the
    monotone-risk half of Assumption 4.2 (M). Applying g is `np.interp` over the fitted knots
    (inputs outside the CAL range are clipped), so a deserialised calibrator scores bit-identically.
    """

    def __init__(self, knots_raw: Sequence[float], knots_fail: Sequence[float]):
        self.knots_raw = np.asarray(knots_raw, dtype=np.float64)
        self.knots_fail = np.asarray(knots_fail, dtype=np.float64)
        if self.knots_raw.ndim != 1 or self.knots_raw.size == 0:
            raise ValueError("a calibrator needs at least one knot")
        if self.knots_raw.shape != self.knots_fail.shape:
            raise ValueError("knots_raw and knots_fail must have the same length")
        if np.any(np.diff(self.knots_raw) <= 0) or np.any(np.diff(self.knots_fail) < 0):
            raise ValueError("knots must be strictly increasing in raw and nondecreasing in fail")

    @classmethod
    def fit(
        cls, raw: Sequence[float] | np.ndarray, passed: Sequence[bool] | np.ndarray
    ) -> Calibrator:
        """Isotonic regression of fail = 1 - passed on the raw score (`isotonic_knots`)."""
        raw = np.asarray(raw, dtype=np.float64)
        fail = 1.0 - np.asarray(passed, dtype=np.float64)
        if raw.shape != fail.shape or raw.ndim != 1 or raw.size == 0:
            raise ValueError("raw and passed must be non-empty 1-D arrays of the same length")
        return cls(*isotonic_knots(raw, fail))

    def __call__(self, raw: float | np.ndarray) -> float | np.ndarray:
        """Calibrated score s = g(raw): a float for a float, an array for an array."""
        out = np.interp(raw, self.knots_raw, self.knots_fail)
        return float(out) if np.ndim(out) == 0 else out

    def to_dict(self) -> dict[str, list[float]]:
        """JSON-plain knots (floats round-trip exactly through `json`)."""
        return {"knots_raw": self.knots_raw.tolist(), "knots_fail": self.knots_fail.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibrator:
        """Inverse of `to_dict`."""
        return cls(d["knots_raw"], d["knots_fail"])


def make_grid(
    cal_scores: Sequence[float] | np.ndarray, alpha: float, m: int = 15, spacing: str = "geometric"
) -> np.ndarray:
    """Threshold grid Q `[m]` from calibrated CAL scores (App. B.5: m = 15, geometric between the
    2% and 98% quantiles).

    Ends: lo = max(P2, 0.001), hi = min(P98, 0.8, max(3 alpha, alpha + 0.05)) (but >= lo), the
    clamps and per-alpha cap as in the authors' code; geometric by default, linear as in that
    code. Thresholds above the per-alpha cap are never safe in practice and would only dilute the
    Bonferroni budget. Raises if the cap falls below P2: then fewer than 2% of CAL items could
    ever be released and the grid cannot be placed.
    """
    scores = np.asarray(cal_scores, dtype=np.float64)
    if scores.size == 0 or not np.all(np.isfinite(scores)):
        raise ValueError("cal_scores must be a non-empty array of finite scores")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if m < 2:
        raise ValueError(f"the grid needs m >= 2 thresholds, got {m}")
    lo = max(float(np.percentile(scores, 2)), GRID_FLOOR)
    cap = max(3 * alpha, alpha + 0.05)
    if lo > cap:
        raise ValueError(
            f"no room for a grid: P2 of the CAL scores ({lo:.4g}) exceeds the cap {cap:.4g} at "
            f"alpha={alpha}; almost every item is riskier than the budget allows"
        )
    # A P98 under the floor (nearly all CAL scores ~0) collapses the grid onto the floor.
    hi = min(max(min(float(np.percentile(scores, 98)), GRID_CEILING), lo), cap)
    if spacing == "geometric":
        return np.geomspace(lo, hi, m)
    if spacing == "linear":
        return np.linspace(lo, hi, m)
    raise ValueError(f"spacing must be 'geometric' or 'linear', got {spacing!r}")


# --------------------------------------------------------------------------- shared kernel


def plugin_bet(n: np.ndarray, fails: np.ndarray, alpha: float) -> np.ndarray:
    """Algorithm 1's bet (line 17) per threshold from the epoch's earlier gated rounds.

    lam = clip((alpha - r_hat) / (1 - alpha)^2, 0, 1/(2(1 - alpha))) with r_hat = fails / n, and 0
    when n = 0. The cap keeps every wealth factor 1 - lam * x inside [1/2, 1 + alpha/(2(1-alpha))].
    Eq. 2 averages over all rounds of the epoch instead; Algorithm 1's mean over gated rounds is
    the conditional excess risk the bet actually faces.
    """
    # (fails - alpha n) / n is r_hat - alpha, and exactly 0 when n = 0 (so is fails).
    mean_excess = (fails - alpha * n) / np.maximum(n, 1)
    return np.minimum(np.maximum(-mean_excess / (1.0 - alpha) ** 2, 0.0), 0.5 / (1.0 - alpha))


def log_certification_threshold(m: int, delta: float, epoch: int, scheduled: bool) -> float:
    """log(1/delta_q): Bonferroni level of each of the m thresholds in `epoch` (App. B.1-B.2).

    Single-epoch (Algorithm 1): delta_q = delta/(2m). Epochs (Algorithm 2): 6 delta/(pi^2 m j^2),
    which sums to delta over all epochs and thresholds. An unscheduled stream that is restarted as a
    new epoch (lost snapshot, changed scorer) uses the epoch formula from j = 2 on; its total is
    delta/2 + (1 - 6/pi^2) delta < delta.
    """
    if not scheduled and epoch == 1:
        return math.log(2 * m / delta)
    return math.log(math.pi**2 * m * epoch**2 / (6 * delta))


def selective_risk_slack(n_released: int | np.ndarray, delta: float) -> float | np.ndarray:
    """Explicit slack of Theorem 5.1 (Eq. 3) with nu = 0, from the proof in App. C.4 (Lemma C.2):
    w.p. >= 1 - 2 delta, R^act_T <= alpha + slack(N_T) for all T; used for monitoring.

    slack(N) = sqrt(log((k+1)(k+2)/delta) / N) with k = max(0, ceil(log2 N) - 1); infinite at N = 0.
    """
    n = np.asarray(n_released, dtype=np.float64)
    safe_n = np.maximum(n, 1.0)
    k = np.maximum(0.0, np.ceil(np.log2(safe_n)) - 1.0)
    out = np.where(n >= 1, np.sqrt(np.log((k + 1) * (k + 2) / delta) / safe_n), np.inf)
    return float(out) if out.ndim == 0 else out


def _check_config(alpha: float, delta: float, grid: np.ndarray, epoch_length: int | None) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    if grid.ndim != 1 or grid.size == 0 or not np.all(np.isfinite(grid)):
        raise ValueError("grid must be a non-empty 1-D array of finite thresholds")
    if np.any(np.diff(grid) < 0):
        raise ValueError("grid must be ascending")
    if epoch_length is not None and epoch_length < 1:
        raise ValueError(f"epoch_length must be a positive number of rounds, got {epoch_length}")


# --------------------------------------------------------------------------- served stream


class CSAError(Exception):
    """A label the stream must refuse; raised before any state changes (maps to HTTP 4xx)."""


class UnknownSeqError(CSAError):
    """The sequence number was never issued by this stream (or predates a lost state)."""


class AlreadyLabelledError(CSAError):
    """The round is closed: it already has a label (or, in sparse mode, was not selected)."""


class AppliedRound(NamedTuple):
    """A round as the e-processes (or, from an abandoned epoch, only the counters) took it."""

    seq: int
    score: float
    released: bool
    epoch: int
    passed: bool | None  # None: not selected for verification (sparse mode)
    expired: bool


class Decision(NamedTuple):
    """Outcome of `CSAController.decide`: release iff a threshold is deployed and score <= it."""

    seq: int
    release: bool
    threshold: float | None


def _uniform(seed: int, seq: int) -> float:
    """Stateless U[0,1) draw from (seed, seq) by SplitMix64's mix: no RNG state to snapshot."""
    return unit_float(mix64(seed * GOLDEN_GAMMA + seq + 1))


class CSAController:
    """One CSA stream as served: decide before release, apply labels in seq order (Algorithm 1
    with the delayed evaluation of App. B.4).

    `decide(score)` issues the next sequence number and gates on the threshold deployed from labels
    already applied, so the gate stays predictable (Assumption 4.2 (P)). `observe(seq, passed)`
    buffers a label and applies every consecutive labelled round from the head of the queue, so
    late labels never reorder the filtration (our choice: arrival order may depend on the outcome).
    Missing labels are imputed as failures through `expire` (our choice: it can only raise the
    increment, so the e-processes stay valid). With `epoch_length` the state resets every that many
    rounds (CSA-Epoch, Algorithm 2); with `sparse_pi_min` each round is selected for verification
    with that probability, independently of its outcome, and selected labels are
    importance-weighted (App. E, Theorem E.1). The single writer (the ControllerActor) owns one
    instance.

    Drift budget nu = `drift_budget` (Theorem 5.1, App. B.5 (ii); the paper never defines its
    "drift-adjusted e-process", so we take its natural reading): every increment becomes
    X_t(q) - nu A_t(q) = A_t(q)((1 - V_t) - (alpha + nu)), i.e. the e-processes test the budget
    alpha + nu (bet and cap from `plugin_bet` at alpha + nu), and the monitored bound is Eq. 3's
    alpha + nu_bar_T + slack(N_T), nu_bar_T the mean nu over released rounds. nu = 0, the default
    that "sufficed in all live cells", is Algorithm 1 exactly. (Theorem 5.3's (eta - nu)^-2 rate
    reads nu the other way, as a margin taken off; A9 follows Eq. 3 and its proof in App. C.4.)
    With `brier_window` the `BrierMonitor` of App. B.5 watches every epoch and starts a new one
    (reason "brier") when it fires. `warm_start` seeds an epoch's e-processes with labelled
    pre-deployment rounds (App. B.5, "Warm start"). Every epoch start is kept in `epoch_log`.
    """

    def __init__(
        self,
        alpha: float,
        delta: float,
        grid: Sequence[float] | np.ndarray,
        epoch_length: int | None = None,
        sparse_pi_min: float | None = None,
        seed: int = 0,
        drift_budget: float = 0.0,
        brier_window: int | None = None,
        brier_threshold: float = 0.2,
    ):
        grid = np.asarray(grid, dtype=np.float64)
        _check_config(alpha, delta, grid, epoch_length)
        if sparse_pi_min is not None and not 0 < sparse_pi_min <= 1:
            raise ValueError(f"sparse_pi_min must lie in (0, 1], got {sparse_pi_min}")
        if not (math.isfinite(drift_budget) and 0 <= drift_budget < 1 - alpha):
            raise ValueError(
                f"drift_budget must lie in [0, 1 - alpha) = [0, {1 - alpha:g}), got {drift_budget}"
            )
        self.alpha = float(alpha)
        self.delta = float(delta)
        self.grid = grid
        self.epoch_length = epoch_length
        self.sparse_pi_min = sparse_pi_min
        self.seed = int(seed)
        self.drift_budget = float(drift_budget)
        self.brier_window = brier_window
        self.brier_threshold = float(brier_threshold)
        self._brier = None if brier_window is None else BrierMonitor(brier_window, brier_threshold)
        self._budget = self.alpha + self.drift_budget  # the e-processes' null: risk >= this
        self._grid_list = grid.tolist()
        self._pi = 1.0 if sparse_pi_min is None else float(sparse_pi_min)
        m = grid.size
        self._ell = np.zeros(m)
        self._n = np.zeros(m, dtype=np.int64)
        self._fails = np.zeros(m, dtype=np.int64)
        self._cert = np.zeros(m, dtype=bool)
        self._cert_seq = np.full(m, -1, dtype=np.int64)
        self._qi = -1
        self._epoch = 1
        self._epoch_start = 0
        self._log_thr = log_certification_threshold(m, self.delta, 1, epoch_length is not None)
        self._first_seq = 0
        self._next_seq = 0
        self._next_apply = 0
        # seq -> [score, released, first gated grid index, epoch, selected for verification]
        self._pending: dict[int, list] = {}
        self._labels: dict[int, tuple[bool, bool]] = {}  # seq -> (passed, expired)
        self._applied = 0
        self._released = 0
        self._released_fails = 0.0  # importance-weighted in sparse mode
        self._released_nu = 0.0  # sum of nu over released rounds (Eq. 3's nu_bar times N)
        self._expired = 0
        self._warm_rounds = 0  # warm-start rounds in the current epoch's e-processes
        self._versions: list[dict[str, Any]] = []
        self._epoch_log: list[dict[str, Any]] = []  # every epoch start after the first
        self.applied_rounds: list[AppliedRound] | None = None
        """Set to a list to have every applied round appended to it (for an audit trail; the
        owner drains it). Not part of the state."""

    # ----------------------------------------------------------------- rounds

    def decide(self, score: float) -> Decision:
        """Issue the next seq and decide release for a calibrated `score` (smaller = safer). O(log m)."""
        s = float(score)
        if not math.isfinite(s):
            raise ValueError(f"score must be finite, got {score!r}")
        seq = self._next_seq
        if self.epoch_length is not None and seq - self._epoch_start >= self.epoch_length:
            self._begin_epoch(self._epoch + 1, seq, "schedule")
        threshold = self._grid_list[self._qi] if self._qi >= 0 else None
        release = threshold is not None and s <= threshold
        selected = self.sparse_pi_min is None or _uniform(self.seed, seq) < self._pi
        self._pending[seq] = [s, release, bisect_left(self._grid_list, s), self._epoch, selected]
        self._next_seq = seq + 1
        if not selected:
            self._drain()
        return Decision(seq, release, threshold)

    def observe(self, seq: int, passed: bool) -> None:
        """Record the verifier's label for `seq`; applies all labelled rounds at the queue head. O(m).

        Raises UnknownSeqError for a seq never issued and AlreadyLabelledError for a closed round,
        in both cases without touching state, so a retried label is harmless.
        """
        self._label(seq, passed, expired=False)

    def expire(self, seq: int) -> None:
        """Close `seq` as a failure because its label timed out (conservative: it only raises X)."""
        self._label(seq, False, expired=True)

    def wants_label(self, seq: int) -> bool:
        """Whether `seq` still needs a verifier label (always, unless sparse mode skipped it)."""
        self._check_known(seq)
        entry = self._pending.get(seq)
        return entry is not None and entry[4] and seq not in self._labels

    @property
    def blocking_seq(self) -> int | None:
        """The seq whose missing label holds back the apply queue, for the timeout sweeper."""
        return self._next_apply if self._next_apply in self._pending else None

    def start_new_epoch(
        self, epoch: int | None = None, next_seq: int | None = None, reason: str = "operator"
    ) -> int:
        """Reset every e-process and abstain until re-certified; returns the new epoch number.

        Rounds decided before the boundary still count in the realised-risk metrics when labelled,
        but never in the new epoch's e-processes. After a lost snapshot, call it on a fresh
        controller with the lost state's `epoch + 1` and `next_seq`, never resume as epoch 1 with
        the full budget: that would be repeated testing. `reason` goes to `epoch_log`.
        """
        epoch = self._epoch + 1 if epoch is None else int(epoch)
        if epoch <= self._epoch:
            raise ValueError(f"new epoch {epoch} must exceed the current epoch {self._epoch}")
        if next_seq is not None and next_seq != self._next_seq:
            if self._next_seq != self._first_seq or next_seq < self._next_seq:
                raise ValueError("next_seq can only move forward on a stream that issued no rounds")
            self._first_seq = self._next_seq = self._next_apply = int(next_seq)
        self._begin_epoch(epoch, self._next_seq, reason)
        return epoch

    def warm_start(self, scores: Sequence[float], passed: Sequence[bool]) -> int:
        """Seed the current epoch's e-processes with n0 labelled pre-deployment rounds; returns n0.

        App. B.5 ("Warm start"): a calibration phase before deployment seeds the e-processes with
        n0 pre-deployment updates. Each (calibrated score, verifier label) pair is applied exactly
        like a round of the epoch (bet from the pairs before it, then the stats; it may certify),
        ahead of every round of the epoch, so the e-processes stay predictable. The pairs take no
        seq, release nothing and stay out of the realised-risk counters and the Brier monitor
        (whose baseline must describe the served traffic it is compared with). They must come
        from the policy and score map the epoch serves and be disjoint from the items that fit g
        and the grid (App. B.5's warm start; reused items would bias the test). Allowed once per
        epoch, before any of its rounds is applied.
        """
        scores = [float(s) for s in scores]
        labels = [bool(p) for p in passed]
        if len(scores) != len(labels):
            raise ValueError(f"{len(scores)} warm-start scores but {len(labels)} labels")
        if not all(math.isfinite(s) for s in scores):
            raise ValueError("warm-start scores must be finite")
        if self._warm_rounds or self._next_apply > self._epoch_start:
            raise ValueError(
                f"epoch {self._epoch} already has rounds in its e-processes; a warm start must "
                "come before them"
            )
        for s, ok in zip(scores, labels, strict=True):
            self._update_eprocesses(bisect_left(self._grid_list, s), not ok, self._epoch_start)
        self._warm_rounds = len(scores)
        return self._warm_rounds

    def carry_over(self, previous: CSAController) -> None:
        """Continue `previous`, a stream whose configuration changed, as this controller's next
        epoch: seqs run on, its open rounds still take their labels, and its realised-risk
        counters and version history carry over; its rounds never enter this configuration's
        e-processes (they were decided under other thresholds)."""
        if self._next_seq != self._first_seq:
            raise ValueError("carry_over needs a controller that has issued no rounds")
        self._first_seq, self._next_seq = previous._first_seq, previous._next_seq
        self._next_apply = previous._next_apply
        self._pending = {seq: list(entry) for seq, entry in previous._pending.items()}
        self._labels = dict(previous._labels)
        self._applied, self._released = previous._applied, previous._released
        self._released_fails, self._expired = previous._released_fails, previous._expired
        self._released_nu = previous._released_nu
        self._versions = [dict(v) for v in previous._versions]
        self._epoch_log = [dict(e) for e in previous._epoch_log]
        self._begin_epoch(previous.epoch + 1, self._next_seq, "config_changed")

    def switch_versions(
        self,
        policy: str | None = None,
        scorer: str | None = None,
        trained_through: int | None = None,
    ) -> int:
        """Record a policy/scorer version switch taking effect at the next seq; returns that seq.

        An update trained on labels up to `trained_through` may serve only later rounds, so those
        labels must already be applied (Assumption 4.2 (P)). A new scorer changes the score map
        and therefore starts a new epoch (reason "scorer") unless the current epoch has no rounds
        yet (our choice: certificates earned under the old map say nothing about
        the new one, and a retrained surrogate may break frontier monotonicity); a new policy alone
        does not (Assumption 4.2 (P) allows one update between rounds).
        """
        if trained_through is not None and trained_through >= self._next_apply:
            raise ValueError(
                f"labels up to seq {trained_through} are not all applied yet "
                f"(next to apply: {self._next_apply}); the update would leak the future"
            )
        current = self.versions
        new = {
            "policy": current["policy"] if policy is None else str(policy),
            "scorer": current["scorer"] if scorer is None else str(scorer),
        }
        if trained_through is not None:
            new["trained_through"] = int(trained_through)
        boundary = self._next_seq
        if self._versions and self._versions[-1]["seq"] == boundary:
            self._versions[-1].update(new)
        else:
            self._versions.append({"seq": boundary, **new})
        # Before the epoch's first round (and warm start) nothing was tested with the old score
        # map: no reset needed.
        if new["scorer"] != current["scorer"] and (
            boundary > self._epoch_start or self._warm_rounds
        ):
            self._begin_epoch(self._epoch + 1, boundary, "scorer")
        return boundary

    @property
    def versions(self) -> dict[str, str | None]:
        """Policy and scorer versions serving the next seq (None before the first switch)."""
        return self.versions_at(self._next_seq)

    def trained_through(self, policy: str) -> int | None:
        """The last seq whose label trained `policy` (as its switch declared; None: none did,
        e.g. the policy deployed at start). Rule R2: it may serve only later seqs."""
        seqs = [
            v["trained_through"]
            for v in self._versions
            if v["policy"] == policy and v.get("trained_through") is not None
        ]
        return max(seqs) if seqs else None

    @property
    def next_seq(self) -> int:
        """The seq the next decision gets."""
        return self._next_seq

    @property
    def next_apply(self) -> int:
        """Every seq below this one is applied (its label is in the e-processes or counters)."""
        return self._next_apply

    def versions_at(self, seq: int) -> dict[str, str | None]:
        """Policy and scorer versions that served `seq`."""
        current: dict[str, str | None] = {"policy": None, "scorer": None}
        for rec in self._versions:
            if rec["seq"] > seq:
                break
            current = {"policy": rec["policy"], "scorer": rec["scorer"]}
        return current

    # ----------------------------------------------------------------- inspection

    @property
    def epoch(self) -> int:
        """Current epoch j (1-based)."""
        return self._epoch

    @property
    def threshold(self) -> float | None:
        """Deployed threshold max C_t, or None while nothing is certified."""
        return self._grid_list[self._qi] if self._qi >= 0 else None

    @property
    def log_wealth(self) -> np.ndarray:
        """log E(q) per threshold in the current epoch `[m]` (a copy)."""
        return self._ell.copy()

    @property
    def certified(self) -> np.ndarray:
        """Sticky certification flags per threshold `[m]` (a copy)."""
        return self._cert.copy()

    @property
    def epoch_log(self) -> list[dict[str, Any]]:
        """Every epoch start after the first: epoch, first_seq, reason ("schedule", "scorer",
        "brier", "config_changed" or the caller's), and for "brier" the monitor's read-out."""
        return [dict(e) for e in self._epoch_log]

    def metrics(self) -> dict[str, Any]:
        """Monitoring view: realised selective risk against Eq. 3's alpha + nu_bar + slack(N),
        release rate, gate, the Brier monitor (None when off) and the epoch's warm-start rounds."""
        n = self._released
        risk = self._released_fails / max(n, 1)
        slack = selective_risk_slack(n, self.delta)
        nu_bar = self._released_nu / max(n, 1)
        return {
            "epoch": self._epoch,
            "decided": self._next_seq - self._first_seq,
            "applied": self._applied,
            "pending": len(self._pending),
            "released": n,
            "risk": risk,
            "release_rate": n / self._applied if self._applied else 0.0,
            "slack": slack,
            "nu_bar": nu_bar,
            "over_bound": risk > self.alpha + nu_bar + slack,
            "expired": self._expired,
            "threshold": self.threshold,
            "certified": [
                q for q, c in zip(self._grid_list, self._cert.tolist(), strict=True) if c
            ],
            "versions": self.versions,
            "warm_rounds": self._warm_rounds,
            "brier": None if self._brier is None else self._brier.view(),
        }

    # ----------------------------------------------------------------- persistence

    def _config(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "delta": self.delta,
            "grid": self._grid_list,
            "epoch_length": self.epoch_length,
            "sparse_pi_min": self.sparse_pi_min,
            "seed": self.seed,
            "drift_budget": self.drift_budget,
            "brier_window": self.brier_window,
            "brier_threshold": self.brier_threshold,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-plain snapshot; `json` round-trips it bit-exactly (floats via repr)."""
        return {
            "format": _STATE_FORMAT,
            "config": self._config(),
            "epoch": self._epoch,
            "epoch_start": self._epoch_start,
            "ell": self._ell.tolist(),
            "n": self._n.tolist(),
            "fails": self._fails.tolist(),
            "cert": self._cert.tolist(),
            "cert_seq": self._cert_seq.tolist(),
            "qi": self._qi,
            "first_seq": self._first_seq,
            "next_seq": self._next_seq,
            "next_apply": self._next_apply,
            "pending": [[seq, *entry] for seq, entry in sorted(self._pending.items())],
            "labels": [[seq, p, e] for seq, (p, e) in sorted(self._labels.items())],
            "applied": self._applied,
            "released": self._released,
            "released_fails": self._released_fails,
            "released_nu": self._released_nu,
            "expired": self._expired,
            "versions": [dict(v) for v in self._versions],
            "warm_rounds": self._warm_rounds,
            "brier": None if self._brier is None else self._brier.state_dict(),
            "epoch_log": [dict(e) for e in self._epoch_log],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a snapshot taken from a controller with the same configuration (else a new epoch).

        Keys added after format 1 was written default to what older snapshots ran under.
        """
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"unknown CSA state format {state.get('format')!r}")
        if {**_CONFIG_DEFAULTS, **state["config"]} != self._config():
            raise ValueError(
                "snapshot configuration differs from this controller's; a changed alpha, delta, "
                "grid or scorer must start a new epoch instead of resuming"
            )
        m = self.grid.size
        self._ell = np.array(state["ell"], dtype=np.float64).reshape(m)
        self._n = np.array(state["n"], dtype=np.int64).reshape(m)
        self._fails = np.array(state["fails"], dtype=np.int64).reshape(m)
        self._cert = np.array(state["cert"], dtype=bool).reshape(m)
        self._cert_seq = np.array(state["cert_seq"], dtype=np.int64).reshape(m)
        self._qi = int(state["qi"])
        self._epoch = int(state["epoch"])
        self._epoch_start = int(state["epoch_start"])
        self._log_thr = log_certification_threshold(
            m, self.delta, self._epoch, self.epoch_length is not None
        )
        self._first_seq = int(state["first_seq"])
        self._next_seq = int(state["next_seq"])
        self._next_apply = int(state["next_apply"])
        self._pending = {
            int(seq): [float(s), bool(r), int(k), int(ep), bool(sel)]
            for seq, s, r, k, ep, sel in state["pending"]
        }
        self._labels = {int(seq): (bool(p), bool(e)) for seq, p, e in state["labels"]}
        self._applied = int(state["applied"])
        self._released = int(state["released"])
        self._released_fails = float(state["released_fails"])
        self._released_nu = float(state.get("released_nu", 0.0))
        self._expired = int(state["expired"])
        self._versions = [dict(v) for v in state["versions"]]
        self._warm_rounds = int(state.get("warm_rounds", 0))
        if self._brier is not None:
            self._brier.load_state_dict(state["brier"])
        self._epoch_log = [dict(e) for e in state.get("epoch_log", [])]

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> CSAController:
        """A controller rebuilt from a snapshot alone (its configuration travels with it)."""
        cfg = {**_CONFIG_DEFAULTS, **state["config"]}
        ctrl = cls(
            cfg["alpha"],
            cfg["delta"],
            cfg["grid"],
            epoch_length=cfg["epoch_length"],
            sparse_pi_min=cfg["sparse_pi_min"],
            seed=cfg["seed"],
            drift_budget=cfg["drift_budget"],
            brier_window=cfg["brier_window"],
            brier_threshold=cfg["brier_threshold"],
        )
        ctrl.load_state_dict(state)
        return ctrl

    # ----------------------------------------------------------------- internals

    def _check_known(self, seq: int) -> None:
        if isinstance(seq, bool) or not isinstance(seq, int | np.integer):
            raise TypeError(f"seq must be an int, got {type(seq).__name__}")
        if not self._first_seq <= seq < self._next_seq:
            raise UnknownSeqError(f"seq {seq} was never issued by this stream")

    def _label(self, seq: int, passed: bool, expired: bool) -> None:
        if not isinstance(passed, bool | np.bool_) and passed not in (0, 1):
            raise TypeError(f"passed must be a bool (or 0/1), got {passed!r}")
        self._check_known(seq)
        entry = self._pending.get(seq)
        if entry is None:
            raise AlreadyLabelledError(f"seq {seq} is closed (labelled, or skipped in sparse mode)")
        if seq in self._labels:
            raise AlreadyLabelledError(f"seq {seq} already has a label waiting to be applied")
        if not entry[4]:
            raise AlreadyLabelledError(f"seq {seq} was not selected for verification (sparse mode)")
        self._labels[int(seq)] = (bool(passed), expired)
        self._drain()

    def _drain(self) -> None:
        """Apply every round at the head of the queue whose label is in (or not needed)."""
        while True:
            seq = self._next_apply
            entry = self._pending.get(seq)
            if entry is None:
                return
            expired = False
            if entry[4]:
                if seq not in self._labels:
                    return
                passed, expired = self._labels.pop(seq)
                self._expired += expired
            else:
                passed = None
            del self._pending[seq]
            self._apply(seq, entry, passed, expired)
            self._next_apply = seq + 1
            if self.applied_rounds is not None:
                self.applied_rounds.append(
                    AppliedRound(seq, entry[0], entry[1], entry[3], passed, expired)
                )

    def _apply(self, seq: int, entry: list, passed: bool | None, expired: bool) -> None:
        score, released, k0, epoch, _ = entry
        self._applied += 1
        if released:
            self._released += 1
            self._released_nu += self.drift_budget
            if passed is False:
                self._released_fails += 1.0 / self._pi
        # Unverified rounds have importance weight 0 (factor 1); rounds from an abandoned epoch
        # feed only the realised-risk counters.
        if passed is None or epoch != self._epoch:
            return
        self._update_eprocesses(k0, not passed, seq)
        # An imputed failure is no verifier judgement of the score: it stays out of the Brier.
        if not expired:
            self._watch_brier(score, not passed)

    def _watch_brier(self, score: float, fail: bool) -> None:
        """Feed the Brier monitor; on an alarm, the next seq to be decided opens a new epoch."""
        if self._brier is not None and self._brier.update(score, fail):
            self._begin_epoch(self._epoch + 1, self._next_seq, "brier", **self._brier.view())

    def _update_eprocesses(self, k0: int, fail: bool, seq: int) -> None:
        """One labelled round gated from grid index k0 on: bet, wealth, stats, certification."""
        if k0 >= self.grid.size:
            return  # above every threshold: no e-process is touched
        x = float(fail) - self._budget
        ell, n, fails, cert = self._ell[k0:], self._n[k0:], self._fails[k0:], self._cert[k0:]
        # The bet comes from rounds before this one (predictable), then the stats absorb this one.
        lam = plugin_bet(n, fails, self._budget)
        ell += np.log1p(-lam * x)
        n += 1
        if fail:
            fails += 1
        newly = (ell >= self._log_thr) & ~cert
        if newly.any():
            cert |= newly
            self._cert_seq[k0:][newly] = seq
            self._qi = max(self._qi, k0 + int(np.flatnonzero(newly)[-1]))

    def _begin_epoch(self, epoch: int, start_seq: int, reason: str, **detail: Any) -> None:
        self._epoch_log.append({"epoch": epoch, "first_seq": start_seq, "reason": reason, **detail})
        self._epoch = epoch
        self._epoch_start = start_seq
        self._warm_rounds = 0
        if self._brier is not None:
            self._brier.reset()
        self._log_thr = log_certification_threshold(
            self.grid.size, self.delta, epoch, self.epoch_length is not None
        )
        self._ell[:] = 0.0
        self._n[:] = 0
        self._fails[:] = 0
        self._cert[:] = False
        self._cert_seq[:] = -1
        self._qi = -1


# --------------------------------------------------------------------------- many streams at once


class CSABatch:
    """CSA on R synchronous streams at once, arrays `[R, m]`: the bench's and the tests' engine.

    Same kernel and arithmetic as `CSAController` (bit-identical log-wealth on the same stream), with
    labels arriving right after each decision. Options used by ablations: `fixed_bet` replaces the
    plug-in bet by a constant (App. G.2, Table 24), and `increment="marginal"` tests the marginal
    increment A(q)(1 - V) - alpha on every round (an A-RCPS-style e-process, which controls
    AR * risk only; App. F.8). `observe(passed, verified)` with a verification mask runs the sparse
    verifier of App. E.
    Read-outs: `log_wealth`, `certified`, `cert_round` `[R, m]` (current epoch), `deployed` grid
    index and `threshold` `[R]` (-1 / NaN = none), `first_cert_round` `[R]` over the whole run.
    """

    def __init__(
        self,
        n_streams: int,
        alpha: float,
        delta: float,
        grid: Sequence[float] | np.ndarray,
        epoch_length: int | None = None,
        fixed_bet: float | None = None,
        increment: str = "selective",
    ):
        grid = np.asarray(grid, dtype=np.float64)
        _check_config(alpha, delta, grid, epoch_length)
        if increment not in ("selective", "marginal"):
            raise ValueError(f"increment must be 'selective' or 'marginal', got {increment!r}")
        if fixed_bet is not None and not 0 <= fixed_bet <= 1 / (1 - alpha):
            raise ValueError(f"a fixed bet must lie in [0, 1/(1 - alpha)], got {fixed_bet}")
        self.name = "CSA" if increment == "selective" else "marginal e-process"
        self.alpha, self.delta, self.grid = float(alpha), float(delta), grid
        self.epoch_length, self.fixed_bet, self.increment = epoch_length, fixed_bet, increment
        shape = (n_streams, grid.size)
        self.log_wealth = np.zeros(shape)
        self.n = np.zeros(shape, dtype=np.int64)
        self.fails = np.zeros(shape, dtype=np.int64)
        self.certified = np.zeros(shape, dtype=bool)
        self.cert_round = np.full(shape, -1, dtype=np.int64)
        self.first_cert_round = np.full(n_streams, -1, dtype=np.int64)
        self.deployed = np.full(n_streams, -1, dtype=np.int64)
        self.threshold = np.full(n_streams, np.nan)
        self.epoch = 1
        self.t = 0
        self._log_thr = log_certification_threshold(grid.size, delta, 1, epoch_length is not None)
        self._scores = np.zeros(n_streams)

    def decide(self, scores: np.ndarray) -> np.ndarray:
        """Release flags `[R]` for this round's scores `[R]`, from the labels of earlier rounds."""
        if self.epoch_length is not None and self.t > 0 and self.t % self.epoch_length == 0:
            self.epoch += 1
            self._log_thr = log_certification_threshold(
                self.grid.size, self.delta, self.epoch, True
            )
            for a in (self.log_wealth, self.n, self.fails, self.certified):
                a[...] = 0
            self.cert_round[...] = -1
            self.deployed[:] = -1
        self._scores = np.asarray(scores, dtype=np.float64)
        has = self.deployed >= 0
        self.threshold = np.where(has, self.grid[np.maximum(self.deployed, 0)], np.nan)
        return has & (self._scores <= self.threshold)

    def observe(self, passed: np.ndarray, verified: np.ndarray | None = None) -> None:
        """Absorb this round's labels `[R]`; `verified` `[R]` marks the rounds the verifier checked."""
        fail = ~np.asarray(passed, dtype=bool)
        ver = np.ones_like(fail) if verified is None else np.asarray(verified, dtype=bool)
        gated = self._scores[:, None] <= self.grid[None, :]
        if self.increment == "selective":
            x = (fail.astype(np.float64) - self.alpha)[:, None]
            upd = gated & ver[:, None]
        else:
            x = (gated & fail[:, None]).astype(np.float64) - self.alpha
            upd = np.broadcast_to(ver[:, None], gated.shape)
        lam = (
            plugin_bet(self.n, self.fails, self.alpha) if self.fixed_bet is None else self.fixed_bet
        )
        self.log_wealth += np.where(upd, np.log1p(-lam * x), 0.0)
        self.n += upd
        self.fails += upd & gated & fail[:, None]
        newly = (self.log_wealth >= self._log_thr) & ~self.certified
        if newly.any():
            self.certified |= newly
            self.cert_round[newly] = self.t
            rows = newly.any(axis=1)
            self.first_cert_round[rows & (self.first_cert_round < 0)] = self.t
            top = self.grid.size - 1 - np.argmax(self.certified[:, ::-1], axis=1)
            self.deployed = np.where(self.certified.any(axis=1), top, -1)
        self.t += 1
