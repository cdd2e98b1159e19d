"""Synthetic CSA streams, the shift cells of the CSA paper (arXiv:2605.20270, Sec. 6.3, App. F.5),
and a runner that plays any release rule on many streams at once and scores it (risk, release rate,
MaxR, PathV: Sec. 6).

Generator G0 (ours: App. G states only s ~ U(0, 1) and tau = 0.5, not the failure curve):
s ~ U(lo_t, hi_t), P(fail | s) = sigmoid((s - c_t)/0.1). Our named cells move c_t (drift, abrupt
shift) or the score range (covariate shift, alternating blocks); `replay_cell` orders a fixed item
set by score as in the paper's shift cells.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rlvr.algorithms.csa import CSABatch, selective_risk_slack
from rlvr.algorithms.csa.baselines import SelectiveMethod


@dataclass
class Streams:
    """R streams of T rounds: calibrated scores, verifier labels and (synthetic only) P(fail | s)."""

    scores: np.ndarray  # [R, T]
    passed: np.ndarray  # [R, T] bool
    fail_prob: np.ndarray | None = None  # [R, T]


def logistic_fail_prob(
    scores: np.ndarray, centre: float | np.ndarray, width: float = 0.1
) -> np.ndarray:
    """G0's P(fail | s) = sigmoid((s - centre)/width), elementwise (centre broadcasts per round)."""
    return 1.0 / (1.0 + np.exp(-(scores - centre) / width))


def g0_selective_risk(q: float | np.ndarray, centre: float = 0.5, width: float = 0.1) -> np.ndarray:
    """r(q) = E[P(fail | s) | s <= q] under G0 with s ~ U(0, 1): the oracle for false certification.

    Closed form of (1/q) * integral_0^q sigmoid((s - c)/w) ds = (w/q) [softplus((q-c)/w) - softplus(-c/w)].
    """
    q = np.asarray(q, dtype=np.float64)
    return (
        width / q * (np.logaddexp(0.0, (q - centre) / width) - np.logaddexp(0.0, -centre / width))
    )


def make_streams(
    n_streams: int,
    horizon: int,
    seed: int,
    fail_prob: Callable[[np.ndarray], np.ndarray],
    score_low: float | np.ndarray = 0.0,
    score_high: float | np.ndarray = 1.0,
) -> Streams:
    """Scores uniform on [score_low_t, score_high_t] (scalars or `[T]`), labels ~ 1 - fail_prob(s)."""
    rng = np.random.default_rng(seed)
    u = rng.random((n_streams, horizon))
    scores = score_low + (np.asarray(score_high) - score_low) * u
    p = fail_prob(scores)
    passed = rng.random((n_streams, horizon)) >= p
    return Streams(scores, passed, p)


def g0_streams(
    n_streams: int,
    horizon: int,
    seed: int,
    centre: float | np.ndarray = 0.5,
    score_low: float | np.ndarray = 0.0,
    score_high: float | np.ndarray = 1.0,
) -> Streams:
    """G0 streams; `centre`, `score_low`, `score_high` are scalars or per-round arrays `[T]`."""
    return make_streams(
        n_streams,
        horizon,
        seed,
        lambda s: logistic_fail_prob(s, centre),
        score_low,
        score_high,
    )


EI_ROUND = 100
"""Requests per Expert-Iteration round in the live protocol (arXiv:2605.20270 Sec. 6.2)."""


def _halves(horizon: int, first: float, second: float) -> np.ndarray:
    out = np.full(horizon, first)
    out[horizon // 2 :] = second
    return out


def synthetic_cell(name: str, n_streams: int, horizon: int, seed: int) -> Streams:
    """Named G0 cells (ours, beside the paper's App. G setting).

    iid: c = 0.5. improving: c rises 0.4 -> 0.6 (frontier nondecreasing, Thm C.1 applies).
    expert_iteration: the live protocol of Sec. 6.2, the policy constant within each round of
    `EI_ROUND` requests and better after each update: c steps up from 0.4 to 0.6 between rounds.
    degrading: c falls 0.6 -> 0.4. abrupt: c = 0.6, then 0.35 from T/2. covariate: s ~ U(0, .5),
    then U(.75, 1) from T/2, c = 0.5. alternating: 100-round blocks of s ~ U(0, .5) and U(.5, 1).
    The last four break the nondecreasing-frontier assumption on purpose.
    """
    t = np.arange(horizon)
    if name == "iid":
        return g0_streams(n_streams, horizon, seed)
    if name == "improving":
        return g0_streams(n_streams, horizon, seed, centre=np.linspace(0.4, 0.6, horizon))
    if name == "expert_iteration":
        rounds = t // EI_ROUND
        centre = 0.4 + 0.2 * rounds / max(1, rounds[-1])
        return g0_streams(n_streams, horizon, seed, centre=centre)
    if name == "degrading":
        return g0_streams(n_streams, horizon, seed, centre=np.linspace(0.6, 0.4, horizon))
    if name == "abrupt":
        return g0_streams(n_streams, horizon, seed, centre=_halves(horizon, 0.6, 0.35))
    if name == "covariate":
        lo, hi = _halves(horizon, 0.0, 0.75), _halves(horizon, 0.5, 1.0)
        return g0_streams(n_streams, horizon, seed, score_low=lo, score_high=hi)
    if name == "alternating":
        hard = (t // 100) % 2 == 1
        return g0_streams(
            n_streams, horizon, seed, score_low=0.5 * hard, score_high=0.5 + 0.5 * hard
        )
    raise ValueError(f"unknown synthetic cell {name!r}; choose one of {SYNTHETIC_CELLS}")


SYNTHETIC_CELLS = (
    "iid",
    "improving",
    "degrading",
    "abrupt",
    "covariate",
    "alternating",
    "expert_iteration",
)


def flip_labels(passed: np.ndarray, p: float, seed: int) -> np.ndarray:
    """A noisy verifier: each label flipped independently with probability p (App. G.4)."""
    flips = np.random.default_rng(seed).random(passed.shape) < p
    return passed ^ flips


# --------------------------------------------------------------------------- replayed item sets


def _passes(pool: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    """`length` items drawn as consecutive shuffled passes over `pool`."""
    if length <= 0:
        return pool[:0]
    n_passes = -(-length // pool.size)
    return np.concatenate([rng.permutation(pool) for _ in range(n_passes)])[:length]


def _replay_order(name: str, by_score: np.ndarray, horizon: int, rng: np.random.Generator):
    n = by_score.size
    easy, hard = by_score[: n // 2], by_score[n // 2 :]
    quarters = np.array_split(by_score, 4)
    n_pass = -(-horizon // n)
    if name == "iid":
        return _passes(by_score, horizon, rng)
    if name == "easy_hard":
        one = [
            np.concatenate([rng.permutation(easy), rng.permutation(hard)]) for _ in range(n_pass)
        ]
        return np.concatenate(one)[:horizon]
    if name == "quartile_rev":
        one = [np.concatenate([rng.permutation(q) for q in quarters]) for _ in range(n_pass)]
        return np.concatenate(one)[:horizon]
    if name == "window_outrun":
        first = np.concatenate([rng.permutation(easy), rng.permutation(hard)])
        later = [
            np.concatenate([rng.permutation(hard), rng.permutation(easy)]) for _ in range(n_pass)
        ]
        return np.concatenate([first, *later])[:horizon]
    if name == "quartile":
        half = horizon // 2
        return np.concatenate(
            [_passes(quarters[0], half, rng), _passes(quarters[-1], horizon - half, rng)]
        )
    if name == "multi":
        n_blocks = -(-horizon // 100)
        easy_seq = _passes(easy, 100 * (n_blocks // 2 + 1), rng)
        hard_seq = _passes(hard, 100 * (n_blocks // 2 + 1), rng)
        blocks = [
            (easy_seq if b % 2 == 0 else hard_seq)[100 * (b // 2) : 100 * (b // 2 + 1)]
            for b in range(n_blocks)
        ]
        return np.concatenate(blocks)[:horizon]
    if name == "adversarial":
        hardest = by_score[n - max(1, n // 10) :]
        tail = np.concatenate([rng.permutation(hardest) for _ in range(5)])[:horizon]
        head = horizon - tail.size
        return np.concatenate(
            [_passes(easy, head // 2, rng), _passes(hard, head - head // 2, rng), tail]
        )
    raise ValueError(f"unknown replay cell {name!r}; choose one of {REPLAY_CELLS}")


REPLAY_CELLS = (
    "iid",
    "easy_hard",
    "quartile_rev",
    "window_outrun",
    "quartile",
    "multi",
    "adversarial",
)


def replay_cell(
    name: str,
    item_scores: np.ndarray,
    item_passed: np.ndarray,
    n_streams: int,
    horizon: int,
    seed: int,
) -> Streams:
    """Replay a fixed calibrated item set as R streams ordered by cell `name` (paper's shift cells).

    easy = lower half by score, hard = upper half. iid: shuffled passes. easy_hard: each pass easy
    then hard. quartile_rev: each pass Q1 -> Q4. window_outrun: pass 0 easy then hard, later passes
    hard then easy. quartile: bottom-quartile passes, then top-quartile passes. multi: alternating
    100-item easy and hard blocks. adversarial: easy passes, hard passes, then 5 repeats of the
    hardest 10%. Each stream reshuffles with its own generator.
    """
    item_scores = np.asarray(item_scores, dtype=np.float64)
    item_passed = np.asarray(item_passed, dtype=bool)
    by_score = np.argsort(item_scores, kind="stable")
    rng = np.random.default_rng(seed)
    order = np.stack([_replay_order(name, by_score, horizon, rng) for _ in range(n_streams)])
    return Streams(item_scores[order], item_passed[order])


# --------------------------------------------------------------------------- running and scoring


@dataclass
class Run:
    """Per-round trace of one method on R streams."""

    released: np.ndarray  # [R, T] bool
    threshold: np.ndarray  # [R, T] gate in force (NaN = none)


def run_method(
    method: SelectiveMethod, streams: Streams, verified: np.ndarray | None = None
) -> Run:
    """Play `method` on every stream, one synchronous round at a time. `verified` `[R, T]` (CSA
    only) marks the rounds a sparse verifier checks; the others reach the e-processes unlabelled."""
    scores, passed = streams.scores, streams.passed
    if verified is not None and not isinstance(method, CSABatch):
        raise ValueError("only CSA runs with a sparse verifier; the baselines need every label")
    released = np.zeros(scores.shape, dtype=bool)
    threshold = np.zeros(scores.shape)
    for t in range(scores.shape[1]):
        released[:, t] = method.decide(scores[:, t])
        threshold[:, t] = method.threshold
        if verified is None:
            method.observe(passed[:, t])
        else:
            method.observe(passed[:, t], verified[:, t])
    return Run(released, threshold)


def summarise(
    released: np.ndarray, passed: np.ndarray, alpha: float, delta: float, burn_in: int = 500
) -> dict[str, np.ndarray]:
    """Per-stream metrics `[R]` of Sec. 6 from release flags and labels `[R, T]`.

    risk: final R^act; release_rate: N_T / T; max_risk: max running R^act over rounds with N_t >=
    burn_in (the final risk if N never gets there); pathv_strict: max_risk > alpha; pathv_slack:
    some round with N_t >= 1 has R^act_t > alpha + slack(N_t) (`selective_risk_slack`); refused:
    nothing released.
    """
    fails = released & ~np.asarray(passed, dtype=bool)
    n = np.cumsum(released, axis=1)
    running = np.cumsum(fails, axis=1) / np.maximum(n, 1)
    risk = running[:, -1]
    after = n >= burn_in
    max_risk = np.where(after.any(axis=1), np.where(after, running, -np.inf).max(axis=1), risk)
    over = (n >= 1) & (running > alpha + selective_risk_slack(n, delta))
    return {
        "risk": risk,
        "release_rate": n[:, -1] / released.shape[1],
        "max_risk": max_risk,
        "pathv_strict": max_risk > alpha,
        "pathv_slack": over.any(axis=1),
        "refused": n[:, -1] == 0,
    }
