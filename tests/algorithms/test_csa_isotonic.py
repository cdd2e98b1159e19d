"""rlvr.algorithms.csa.isotonic: pool-adjacent-violators against hand values and against the
min-max formula of isotonic regression, which characterises the fit independently of PAVA."""

from __future__ import annotations

import numpy as np
import pytest

from rlvr.algorithms.csa.isotonic import isotonic_knots


def min_max_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The isotonic fit at each unique x: max over j <= i of min over k >= i of the weighted mean
    of blocks j..k (Robertson, Wright and Dykstra 1988, Thm. 1.4.4), O(n^3)."""
    xs, where, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(where, weights=y)
    n = xs.size
    fit = np.array(
        [
            max(
                min(sums[j : k + 1].sum() / counts[j : k + 1].sum() for k in range(i, n))
                for j in range(i + 1)
            )
            for i in range(n)
        ]
    )
    return xs, fit


def test_hand_values():
    # already nondecreasing: every knot kept
    xs, fit = isotonic_knots([0.0, 1.0, 2.0], [0.0, 0.5, 1.0])
    assert xs.tolist() == [0.0, 1.0, 2.0] and fit.tolist() == [0.0, 0.5, 1.0]
    # 1, 0 violate: pooled to 1/2, a flat run whose two end knots stay
    xs, fit = isotonic_knots([0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 0.0, 1.0])
    assert xs.tolist() == [0.0, 1.0, 2.0, 3.0] and fit.tolist() == [0.0, 0.5, 0.5, 1.0]
    # ties in x pool first (x=1: mean of 1, 0, 0 = 1/3), then 1/3 > 0 at x=2 pools to 1/4
    xs, fit = isotonic_knots([1.0, 1.0, 1.0, 2.0, 3.0], [1.0, 0.0, 0.0, 0.0, 1.0])
    assert xs.tolist() == [1.0, 2.0, 3.0] and fit.tolist() == [0.25, 0.25, 1.0]
    # unsorted input is sorted by x; 1, 1, 0 at x = 1..3 pool to 2/3, a flat run of three unique
    # x that keeps its end knots only
    xs, fit = isotonic_knots([4.0, 0.0, 2.0, 1.0, 3.0], [1.0, 0.0, 1.0, 1.0, 0.0])
    assert xs.tolist() == [0.0, 1.0, 3.0, 4.0] and fit.tolist() == [0.0, 2 / 3, 2 / 3, 1.0]


def test_edge_cases():
    assert [a.tolist() for a in isotonic_knots([0.3], [1.0])] == [[0.3], [1.0]]
    # all ties: one knot at the mean
    assert [a.tolist() for a in isotonic_knots([0.5] * 4, [1, 0, 0, 0])] == [[0.5], [0.25]]
    # strictly decreasing: one flat run at the overall mean
    xs, fit = isotonic_knots([0.0, 1.0, 2.0], [1.0, 0.5, 0.0])
    assert xs.tolist() == [0.0, 2.0] and fit.tolist() == [0.5, 0.5]
    # the fit is clipped to [y_min, y_max]
    xs, fit = isotonic_knots([0.0, 1.0, 2.0], [-1.0, 0.5, 3.0])
    assert fit.tolist() == [0.0, 0.5, 1.0]
    for bad in (([], []), ([0.0, 1.0], [1.0]), ([[0.0]], [[1.0]]), ([np.nan], [1.0])):
        with pytest.raises(ValueError):
            isotonic_knots(*bad)


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_min_max_formula(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    x = rng.integers(0, 12, size=n) / 12.0  # ties are common
    y = (rng.random(n) < 0.2 + 0.6 * x).astype(np.float64)
    xs, fit = isotonic_knots(x, y)
    ref_x, ref_fit = min_max_fit(x, y)
    # interpolating the kept knots reproduces the fit at every unique x; block means are sums of
    # at most 40 zeros and ones over a count, rounded once, so 1e-12 is ample
    np.testing.assert_allclose(np.interp(ref_x, xs, fit), ref_fit, rtol=0, atol=1e-12)
    assert np.all(np.diff(xs) > 0) and np.all(np.diff(fit) >= 0)
    # dropped knots are interior points of flat runs only
    interior = ~np.isin(ref_x, xs)
    for i in np.flatnonzero(interior):
        assert ref_fit[i - 1] == ref_fit[i] == ref_fit[i + 1]
