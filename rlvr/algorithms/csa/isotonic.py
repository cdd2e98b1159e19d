"""Isotonic (nondecreasing) least-squares regression by pool-adjacent-violators, in numpy.

CSA maps a raw score to a calibrated failure probability with it (arXiv:2605.20270, Sec. 4.2 and
App. H). Written here rather than taken from scikit-learn, which would otherwise be imported by
transformers into every policy, engine and driver process (about 0.1 GiB each).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def isotonic_knots(
    x: Sequence[float] | np.ndarray,
    y: Sequence[float] | np.ndarray,
    y_min: float = 0.0,
    y_max: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """The nondecreasing fit of `y` on `x` as interpolation knots (x strictly increasing).

    Tied x are pooled to their mean y, weighted by their count; adjacent blocks whose means
    decrease are merged until none do; the fit is clipped to [y_min, y_max]. A flat run keeps only
    its two end knots: linear interpolation between the knots is the same function. scikit-learn's
    IsotonicRegression gives the same function (X_thresholds_, y_thresholds_; within 2.3e-16 on
    2,000 random fits), with an extra knot where its running means differ in the last bit.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError("x and y must be non-empty 1-D arrays of the same length")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("x and y must be finite")
    xs, where, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(where, weights=y, minlength=xs.size)
    # blocks of consecutive unique x: their y sum, their weight and how many unique x they span
    block_sum: list[float] = []
    block_weight: list[float] = []
    block_span: list[int] = []
    for s, w in zip(sums.tolist(), counts.tolist(), strict=True):
        block_sum.append(s)
        block_weight.append(w)
        block_span.append(1)
        while len(block_sum) > 1 and (
            block_sum[-2] / block_weight[-2] > block_sum[-1] / block_weight[-1]
        ):
            s, w, n = block_sum.pop(), block_weight.pop(), block_span.pop()
            block_sum[-1] += s
            block_weight[-1] += w
            block_span[-1] += n
    means = np.array(block_sum) / np.array(block_weight)
    fit = np.clip(np.repeat(means, block_span), y_min, y_max)
    keep = np.ones(fit.size, dtype=bool)
    keep[1:-1] = (fit[1:-1] != fit[:-2]) | (fit[1:-1] != fit[2:])
    return xs[keep], fit[keep]
